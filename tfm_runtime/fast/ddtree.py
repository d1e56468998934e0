"""The DDTree build as L shape-static depth steps: no heap, no per-node Python, no host synchronisation (and the
greedy DFlash chain, `StaticChainBuilder`, in the same form).

`StaticDDTreeBuilder` builds the tree `tfm_runtime.tree.build_ddtree` builds (the same nodes in the same order, the
same parents, depths and log q, ties broken the same way). The reference pops paths from a heap keyed by
(-score, rank path), where a path is a tuple of per-depth ranks (rank r at depth d: the r-th most likely token of
draft_logits[d - 1], equal log-probs in token order) and its score the float64 sum of their log-probs. Each path's
key is larger than the key of the entry that pushed it (its previous sibling or its parent), so the heap pops every
path in increasing key order: the tree is the first `budget` paths of finite score in that order, nodes in that
order. A path among the first `budget` has at most budget - 1 better paths of its own length, and so has its
prefix, so a beam of the `budget` best paths per depth holds every node:

    beam_0:      the root (score 0), padded with invalid entries (score -inf) to B = budget
    depth d:     children beam_{d-1} x top-k tokens of depth d, [B, k] -> the B best by (score, rank path)
    merge:       the L beams, [L * B] paths -> sorted by (score descending, rank path ascending) -> first B valid

Equal scores go to the lexicographically smaller rank path, a prefix before its extensions (as Python compares the
heap's tuples). Within one depth the beam is kept in rank-path order, so a child's flat index (parent * k + rank)
is its rank-path order and one stable sort by score selects the next beam. Across depths the rank paths are padded
with -1 and packed into a few int64 keys (base k + 1), sorted stably before the score.

Tensors (B = budget, k = min(budget, V), L depths, C = packed rank-path keys):
    top_lp [L, k] float64, top_tok [L, k] long        per-depth log-probs and tokens by rank
    beam_score [L+1, B] float64                       beam d's path scores (-inf: invalid), in rank-path order
    beam_ranks [L+1, B, L] long                       beam d's rank paths (-1 past depth d)
    beam_parent [L+1, B] long                         index of each path's prefix in beam d - 1
    beam_tok [L+1, B] long, beam_lp [L+1, B] float64  the last token of each path and its log-prob
Output (WeaverTrees layout, batch 1): tokens, parents, depths [1, B+1] long, draft_logprobs [1, B+1] float64,
num_nodes [1]; nodes past num_nodes are padding (token 0, parent -1, depth 0, log q 0).
"""
from __future__ import annotations

import math

import torch

from tfm_runtime.fast.graphs import feed_graph_inputs
from tfm_runtime.fast.weaver_tree import WeaverTrees


class LogitTreeBuilder:
    """A tree built from the bonus token and the draft logits alone, by `_build` (a fixed op sequence, no host
    reads): `build` runs it, or replays the CUDA graph `capture` recorded. Outputs: WeaverTrees of one row."""

    def __init__(self, budget: int, L: int, V: int, device=None):
        if min(budget, L, V) < 1:
            raise ValueError(f"budget, L and V must be >= 1, got budget={budget}, L={L}, V={V}")
        self.budget, self.L, self.V = budget, L, V
        self.device = torch.device(device or "cpu")
        self._graph = None
        self._graph_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._aliased = False                             # the graph reads the caller's tensors (`capture(alias=)`)
        self._graph_out: WeaverTrees | None = None

    @torch.no_grad()
    def build(self, root: torch.Tensor, draft_logits: torch.Tensor) -> WeaverTrees:
        """root [1] long (the bonus token); draft_logits [L, V] -> WeaverTrees of one row: fresh tensors, or after
        `capture` the graph's outputs (overwritten by the next build)."""
        self._check(root, draft_logits)
        if self._graph is None:
            return self._build(root, draft_logits)
        feed_graph_inputs(self._graph_inputs, (root, draft_logits), self._aliased)
        self._graph.replay()
        return self._graph_out

    @torch.no_grad()
    def capture(self, root: torch.Tensor, draft_logits: torch.Tensor, warmup: int = 2, alias: bool = False) -> None:
        """Capture one build in a CUDA graph (inputs copied into static buffers shaped like these examples); later
        `build` calls copy their inputs there and replay it. `alias`: the graph reads these tensors themselves (a
        caller's fixed buffers), and `build` takes exactly them, with no copy. CUDA only."""
        self._check(root, draft_logits)
        if draft_logits.device.type != "cuda":
            raise RuntimeError("CUDA-graph capture needs a CUDA device; on the CPU `build` runs eagerly")
        self._graph_inputs = (root, draft_logits) if alias else (root.clone(), draft_logits.clone())
        self._aliased = alias
        dev = draft_logits.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):                     # compile kernels and fill the allocator before capture
            for _ in range(warmup):
                self._build(*self._graph_inputs)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._graph_out = self._build(*self._graph_inputs)
        self._graph = graph

    def _check(self, root, draft_logits) -> None:
        if tuple(draft_logits.shape) != (self.L, self.V) or tuple(root.shape) != (1,):
            raise ValueError(f"root must be [1] and draft_logits [{self.L}, {self.V}], got {list(root.shape)} and "
                             f"{list(draft_logits.shape)}")

    def _build(self, root: torch.Tensor, draft_logits: torch.Tensor) -> WeaverTrees:
        """root [1] long, draft_logits [L, V] -> WeaverTrees of one row [1, N+1]."""
        raise NotImplementedError


class StaticDDTreeBuilder(LogitTreeBuilder):
    """DDTree of `budget` draft nodes over L depths of V-way draft logits, shape-static (module docstring); `capture`
    records one build in a CUDA graph that later builds replay."""

    def __init__(self, budget: int, L: int, V: int, device=None):
        super().__init__(budget, L, V, device)
        B = budget
        self.k = k = min(budget, V)
        # rank-path components per packed int64 key: (k + 1) ** per < 2 ** 63
        self.per = max(1, int(63 / math.log2(k + 1)))
        while (k + 1) ** self.per >= 2 ** 63:
            self.per -= 1
        long = dict(device=self.device, dtype=torch.long)
        self.child_rank = torch.arange(k, **long).repeat(B)                                 # [B*k]
        self.child_parent = torch.arange(B, **long).repeat_interleave(k)                   # [B*k]
        self.pow = (k + 1) ** torch.arange(self.per - 1, -1, -1, **long)                    # [per]
        self.depth_of = torch.arange(1, L + 1, **long).repeat_interleave(B)               # [L*B]

    def _build(self, root: torch.Tensor, draft_logits: torch.Tensor) -> WeaverTrees:
        """One build (a fixed op sequence, no host reads)."""
        L, B, k = self.L, self.budget, self.k
        dev = draft_logits.device
        if self.child_rank.device != dev:
            self.child_rank, self.child_parent, self.pow, self.depth_of = (
                t.to(dev) for t in (self.child_rank, self.child_parent, self.pow, self.depth_of))
            self.device = dev
        logp = torch.log_softmax(draft_logits.to(torch.promote_types(draft_logits.dtype, torch.float32)), -1)
        top_lp, top_tok = logp.sort(dim=-1, descending=True, stable=True)                  # [L, V]
        top_lp, top_tok = top_lp[:, :k].double(), top_tok[:, :k]                            # [L, k]
        score = torch.full((B,), -math.inf, dtype=torch.float64, device=dev)               # [B] beam_0
        score[:1].zero_()                                                                   # on the device: capturable
        ranks = torch.full((B, L), -1, dtype=torch.long, device=dev)                        # [B, L]
        scores, all_ranks, parents, toks, lps = [], [], [], [], []
        for d in range(L):
            child = (score[:, None] + top_lp[d][None, :]).reshape(-1)                       # [B*k] rank-path order
            order = child.sort(descending=True, stable=True).indices[:B]                    # [B] the best B
            order = order.sort().values                                                     # [B] back in path order
            parent, rank = self.child_parent[order], self.child_rank[order]                 # [B], [B]
            score = child[order]                                                            # [B]
            ranks = ranks[parent]                                                           # [B, L] a copy
            ranks[:, d] = rank
            scores.append(score), all_ranks.append(ranks), parents.append(parent)
            toks.append(top_tok[d][rank]), lps.append(top_lp[d][rank])
        score = torch.cat(scores)                                                           # [L*B]
        ranks = torch.cat(all_ranks)                                                        # [L*B, L]
        # global order: rank path ascending (packed keys, last chunk first), then score descending, all stable
        perm = torch.arange(L * B, device=dev)                                              # [L*B]
        for lo in reversed(range(0, L, self.per)):
            chunk = ranks[:, lo: lo + self.per] + 1                                        # [L*B, <=per]
            key = (chunk * self.pow[self.per - chunk.shape[1]:]).sum(-1)                    # [L*B]
            perm = perm[key[perm].sort(stable=True).indices]
        perm = perm[score[perm].sort(descending=True, stable=True).indices][:B]            # [B] first B paths
        valid = score[perm] > -math.inf                                                     # [B]
        # node ids: path u at sorted position i becomes node i + 1; prefixes always come earlier
        node_of = torch.zeros(L * B, dtype=torch.long, device=dev)                          # [L*B]
        node_of[perm] = torch.arange(1, B + 1, device=dev)
        flat_parent = torch.cat([torch.full((B,), -1, dtype=torch.long, device=dev)] +
                                [p + (d - 1) * B for d, p in enumerate(parents) if d > 0])   # [L*B] prefix index
        parent_node = torch.where(flat_parent >= 0, node_of[flat_parent.clamp(min=0)], 0)   # [L*B]
        z = torch.zeros(1, dtype=torch.long, device=dev)
        tokens = torch.cat([root.to(dev), torch.where(valid, torch.cat(toks)[perm], 0)])    # [B+1]
        parents_out = torch.cat([z - 1, torch.where(valid, parent_node[perm], -1)])         # [B+1]
        depths = torch.cat([z, torch.where(valid, self.depth_of[perm], 0)])         # [B+1]
        logq = torch.cat([z.double(), torch.where(valid, torch.cat(lps)[perm], 0.0)])       # [B+1]
        num_nodes = 1 + valid.sum(0, keepdim=True)                                          # [1]
        return WeaverTrees(tokens[None], parents_out[None], depths[None], logq[None], num_nodes,
                           torch.zeros(1, dtype=torch.bool, device=dev))


class StaticChainBuilder(LogitTreeBuilder):
    """The greedy DFlash chain (`tfm_runtime.tree.build_chain` at temperature 0): min(budget, L) draft nodes, the
    depth-d token the argmax of draft_logits[d - 1], log q its log-softmax (float64 here)."""

    def __init__(self, budget: int, L: int, V: int, device=None):
        super().__init__(budget, L, V, device)
        self.n = min(budget, L)

    def _build(self, root: torch.Tensor, draft_logits: torch.Tensor) -> WeaverTrees:
        n, dev = self.n, draft_logits.device
        logits = draft_logits[:n].to(torch.promote_types(draft_logits.dtype, torch.float32))   # [n, V]
        toks = logits.argmax(-1)                                                               # [n]
        logq = torch.log_softmax(logits, -1).gather(1, toks[:, None])[:, 0].double()          # [n]
        z = torch.zeros(1, dtype=torch.long, device=dev)
        steps = torch.arange(n + 1, device=dev)                                                # [n+1]
        return WeaverTrees(torch.cat([root.to(dev), toks])[None], (steps - 1)[None], steps[None],
                           torch.cat([z.double(), logq])[None], torch.full((1,), n + 1, device=dev),
                           torch.zeros(1, dtype=torch.bool, device=dev))
