"""The Weaver tree build as a fixed sequence of batched tensor steps: no per-node Python, no host synchronisation.

`StaticWeaverTreeBuilder` builds, for B rows at once, the trees `tfm_runtime.weaver_tree.build_weaver_trees` builds
(the same nodes in the same order, the same parents, depths and log q, ties broken the same way), with every buffer
allocated once on the builder, so that one build can be captured in a CUDA graph and replayed.

The reference grows each tree best-first from a heap: it pops up to `width` entries by (highest score, earliest
insertion), places them as nodes, expands them in one batched Weaver step and pushes each expanded node's top-E
children (E = min(expand, K)). Here every tree runs the same fixed number R of rounds (`weaver_tree_rounds`):

    root step:  one Weaver step (width 1, K/V slot 0) on the root -> its children enter the frontier
    round r = 1 .. R:
        rank:   each frontier entry's rank in a stable sort by score, descending (rows are in insertion order,
                below); the entries of rank < width are this round's `width` placement slots
        place:  slot w becomes a node when its entry is valid and w < budget + 1 - count (the remaining budget)
        keep:   the entries of rank width .. width+budget-1 stay, in rank order; the rest can never be placed
                (at most `budget` more nodes are ever placed and later entries only push them further down)
        step:   (r < R) one Weaver step over the `width` slots (K/V slots 1+(r-1)width ..): slot w sees the prefix,
                its parent's ancestors, the parent and itself (its row of `mask`, written by place); a slot that is
                not placed, or sits at depth L, is padding (token 0, depth 0, sees only itself) as in the reference,
                and pushes nothing
        push:   slot w's top-E candidates of row depth enter the frontier as children (invalid where log q = -inf)
    finish:     placement slots -> node ids by a cumulative sum over slots (placement order = node order)

Equal scores go to the earlier push, as in the heap. The frontier's rows are in push order among equal scores: the
kept entries come first, in rank order (equal scores in push order) and all pushed before the last step's children,
which follow in the order the reference's heap pushes them, slot w's child j at row N + w * E + j (the heap skips
the invalid children, which does not change the relative order). So a stable sort breaks ties as the heap does.
Scores are float64 sums of the float64 log q of each step, as the reference's Python floats. Each node's Weaver step
sees the keys the reference's step sees for it (the prefix, its ancestors' slots, itself). The reference sizes a
step by the row that expands most nodes, so where its step is narrower than `width` the same keys sit at other
offsets and products of other shapes can round the last bit of log q differently (the reference's own log q for a
row moves the same way with the other rows of its batch); where every reference step is `width` wide, log q is equal
bit for bit.

Why R depends on L as well: the reference places fewer than `width` nodes in a round when its frontier holds fewer
entries ("short" rounds: expand < width, invalid candidates, nodes at depth L that expand nothing), so its round
count is data dependent. A short round consumes the whole frontier, so the shallowest frontier depth grows by one
from one short round to the next: at most L short rounds, each placing >= 1 node, the other rounds placing `width`.
`weaver_tree_rounds(budget, width, L)` is the largest round count that allows, hence every tree is finished after
R rounds. Most trees need only the R1 = `weaver_tree_first_rounds(budget, width, E)` rounds a tree takes when every
candidate is valid and no node reaches depth L (ceil(budget / width) when E >= width; with E < width the first
rounds are short while the frontier fills), so a build runs in two phases: rounds 1..R1, then, only when a tree is
unfinished (one host read of `truncated`), rounds R1+1..R; the result equals the R-round build. A smaller `rounds`
runs faster and reports the trees it may have cut short in `truncated`.

Tensors on the builder (B rows, N = budget, Wd = width, E = children per node, K candidates, L depths,
R rounds, S = 1 + (R-1) Wd K/V slots, P = 1 + R Wd placement slots, M = N + Wd E frontier entries):

    state.k[i], state.v[i]  [B, nh, 1+L+S, hd]  Weaver K/V per layer (WeaverState.static): the prefix, then the slots
    mask                    [B, S, P0+S] bool   row s: what the node in slot s attends to: the prefix (P0 = 1 + L
                                                keys, always), then its ancestors' K/V slots and its own
    visible                 [B, S, S] bool      mask[:, :, P0:], the node-slot part, written by place
    front_int               [B, M, 3] long      frontier (parent slot, token, depth); rows 0..N-1 the kept
                                                entries in rank order, rows N.. the children of the last step
    front_flt               [B, M, 2] float64   frontier (score, log q); score -inf marks an invalid entry
    slot_int                [B, P, 3] long      placement slots (parent slot, token, depth); slot 0 the root
    slot_flt                [B, P, 2] float64   placement slots (score, log q)
    slot_placed             [B, P] bool         the slot holds a node
    count                   [B] long            nodes placed so far (root included)
    perm                    [B, M] long         scratch: perm[b, k] = the frontier entry of rank k
    cand_logits             [B, L, K] >= fp32   the input's candidate logits in the scoring's dtype
    placed_out              5 x [B, Wd]         one round's slots: token, depth (0 where not active), score, active,
                                                and the candidate row of that depth (b * L + depth)
    tokens, parents, depths [B, N+2] long       output nodes (column N+1 collects the writes of unplaced slots)
    draft_logprobs          [B, N+2] float64    output log q (root 0)
    num_nodes               [B] long            nodes per tree (<= N+1)
    truncated               [B] bool            the tree could still grow with more rounds (always False at the
                                                default R except where every child of a last-round node is invalid)

Outputs past a tree's `num_nodes` are padding: token 0, parent -1, depth 0, log q 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tfm_kernels.tree_ancestors import ancestors_ref, tree_ancestors
from tfm_kernels.weaver_frontier import finish as fused_finish
from tfm_kernels.weaver_frontier import finish_ref, place_ref, push_ref
from tfm_kernels.weaver_frontier import place as fused_place
from tfm_kernels.weaver_frontier import push as fused_push
from tfm_runtime.fast.graphs import feed_graph_inputs
from tfm_runtime.models.common import kernel_device
from tfm_runtime.models.weaver import Weaver, WeaverState
from tfm_runtime.tree import Tree
from tfm_runtime.weaver_tree import step_width


def weaver_tree_rounds(budget: int, width: int, lookahead: int) -> int:
    """The most placement rounds the reference best-first build can take: at most `lookahead` short rounds (>= 1
    node each), the others `width` nodes each, the last one possibly cut by the budget."""
    best = 0
    for last in (0, 1):                                         # 1: a last round that fills the budget
        for short in range(min(lookahead, budget - last) + 1):
            best = max(best, short + last + (budget - short - last) // width)
    return max(best, 1)


def weaver_tree_first_rounds(budget: int, width: int, expand: int) -> int:
    """The rounds of a build in which every candidate is valid and no node reaches the last depth: round r places
    min(width, frontier) nodes, each of which adds `expand` children to the frontier (the root's start it)."""
    placed, frontier, rounds = 0, expand, 0
    while placed < budget:
        p = min(width, frontier, budget - placed)
        placed, frontier, rounds = placed + p, frontier + p * (expand - 1), rounds + 1
    return rounds


@dataclass(frozen=True)
class WeaverTrees:
    """B trees as padded rows (views of the builder's buffers, overwritten by its next build).

    tokens, parents, depths [B, N+1] long; draft_logprobs [B, N+1] float64; num_nodes [B] long; truncated [B] bool.
    """
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    draft_logprobs: torch.Tensor
    num_nodes: torch.Tensor
    truncated: torch.Tensor

    def tree(self, b: int) -> Tree:
        """Row b as a `Tree` (reads the node count on the host)."""
        n = int(self.num_nodes[b])
        return Tree(tokens=self.tokens[b, :n].clone(), parents=self.parents[b, :n].clone(),
                    depths=self.depths[b, :n].clone(), draft_logprobs=self.draft_logprobs[b, :n].clone())

    def trees(self) -> list[Tree]:
        return [self.tree(b) for b in range(self.tokens.shape[0])]


class StaticWeaverTreeBuilder:
    """Best-first Weaver trees for `batch` rows in R shape-static rounds, buffers allocated once (module docstring).

    `K`, `L`: candidates per depth and depths of the inputs (cand_ids [B, L, K]); the tree uses the first
    min(L, weaver.cfg.lookahead) depths, as the reference. `width` defaults to ceil(budget / 16) as the reference;
    `rounds` defaults to `weaver_tree_rounds`, which reproduces the reference on every input.
    """

    def __init__(self, weaver: Weaver, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, budget: int, *,
                 K: int, L: int, batch: int, expand: int = 8, width: int | None = None, rounds: int | None = None,
                 device=None, dtype=None):
        if budget < 1 or (rounds is not None and rounds < 1):
            raise ValueError(f"budget and rounds must be >= 1, got budget={budget}, rounds={rounds}")
        width = width or step_width(budget)
        if min(width, expand, K, L, batch) < 1 or min(L, weaver.cfg.lookahead) < 1:
            raise ValueError(f"width, expand, K, L, batch and the Weaver lookahead must be >= 1, got width={width}, "
                             f"expand={expand}, K={K}, L={L}, batch={batch}, lookahead={weaver.cfg.lookahead}")
        p = next(weaver.parameters())
        self.device = torch.device(device) if device is not None else p.device
        self.dtype = dtype or p.dtype
        self.weaver, self.embed_weight, self.lm_head_weight = weaver, embed_weight, lm_head_weight
        self.budget, self.width, self.K, self.L_in, self.batch = budget, width, K, L, batch
        self.L = min(L, weaver.cfg.lookahead)
        self.E = min(expand, K)
        self.rounds = rounds or weaver_tree_rounds(budget, width, self.L)
        self.first_rounds = min(self.rounds, weaver_tree_first_rounds(budget, width, self.E))   # R1: first phase
        B, N, Wd, E, R = batch, budget, width, self.E, self.rounds
        S, P, M = 1 + (R - 1) * Wd, 1 + R * Wd, N + Wd * E
        dev, cfg = self.device, weaver.cfg
        long = dict(device=dev, dtype=torch.long)
        f64 = dict(device=dev, dtype=torch.float64)

        self.state = WeaverState.static(cfg.num_layers, B, cfg.num_heads, 1 + self.L, cfg.d_rank // cfg.num_heads, S,
                                        device=dev, dtype=self.dtype)   # k, v [B, nh, 1+L+S, hd] per layer
        P0 = self.state.prefix_len
        self.mask = torch.zeros(B, S, P0 + S, device=dev, dtype=torch.bool)    # [B, S, P0+S]
        self.mask[:, :, :P0] = True                                            # every node sees the prefix
        self.visible = self.mask[:, :, P0:]                                    # [B, S, S]
        self.visible.diagonal(dim1=1, dim2=2).fill_(True)                      # and itself (the root: nothing else)
        self.front_int = torch.zeros(B, M, 3, **long)                           # [B, M, (parent, token, depth)]
        self.front_flt = torch.zeros(B, M, 2, **f64)                            # [B, M, (score, log q)]
        self.slot_int = torch.zeros(B, P, 3, **long)                            # [B, P, (parent, token, depth)]
        self.slot_flt = torch.zeros(B, P, 2, **f64)                             # [B, P, (score, log q)]
        self.slot_placed = torch.zeros(B, P, device=dev, dtype=torch.bool)      # [B, P]
        # slot 0 is the root (no parent, depth 0, score and log q 0): no step writes it, a build sets only its token
        self.slot_int[:, 0, 0], self.slot_placed[:, 0] = -1, True
        self.count = torch.zeros(B, **long)                                     # [B]
        self.perm = torch.zeros(B, M, **long)                                   # [B, M]
        # the candidates' DFlash logits in the scoring's dtype (>= fp32), converted once per build, not per step
        self.cand_logits = torch.zeros(B, L, K, device=dev, dtype=torch.promote_types(self.dtype, torch.float32))
        self.tokens = torch.zeros(B, N + 2, **long)                             # [B, N+2]
        self.parents = torch.zeros(B, N + 2, **long)                            # [B, N+2]
        self.depths = torch.zeros(B, N + 2, **long)                             # [B, N+2]
        self.draft_logprobs = torch.zeros(B, N + 2, **f64)                      # [B, N+2]
        self.num_nodes = torch.zeros(B, **long)                                 # [B]
        self.truncated = torch.zeros(B, device=dev, dtype=torch.bool)           # [B]
        # constants
        self.placed_out = (torch.zeros(B, Wd, **long), torch.zeros(B, Wd, **long),
                           torch.zeros(B, Wd, **f64), torch.zeros(B, Wd, device=dev, dtype=torch.bool),
                           torch.zeros(B, Wd, **long))
        self.fused_frontier = dev.type == "cuda"                # the frontier steps in one Triton launch each
        self.root_depth = torch.zeros(B, 1, **long)                             # [B, 1]
        self.root_active = torch.ones(B, 1, device=dev, dtype=torch.bool)       # [B, 1]
        self.root_score = torch.zeros(B, 1, **f64)                              # [B, 1]
        self.row_base = torch.arange(B, **long)[:, None] * L                    # [B, 1] tree b's first candidate row
        self.result = WeaverTrees(self.tokens[:, : N + 1], self.parents[:, : N + 1], self.depths[:, : N + 1],
                                  self.draft_logprobs[:, : N + 1], self.num_nodes, self.truncated)
        self._graph = None                                # (first phase, second phase or None) once captured
        self._graph_inputs: tuple[torch.Tensor, ...] | None = None
        self._aliased = False                             # the graphs read the caller's tensors (`capture(alias=)`)
        self._last_inputs: tuple[torch.Tensor, ...] | None = None     # the eager build's inputs, for `finish`

    # ---- public --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def build(self, roots: torch.Tensor, h_final: torch.Tensor, dflash_hidden: torch.Tensor, cand_ids: torch.Tensor,
              cand_logits: torch.Tensor, finish: bool = True) -> WeaverTrees:
        """roots [B] long; h_final [B, H]; dflash_hidden [B, L, H]; cand_ids/cand_logits [B, L, K] (DFlash top-K,
        raw logits) -> WeaverTrees (views of the builder's buffers). Replays the CUDA graph after `capture`.
        `finish=False`: the first phase only, with no host read; trees it leaves `truncated` are completed by
        `finish()`, so that a caller can read `truncated` together with its own results (FastDecoder: with the
        verify of the tree, which it repeats in the rare case that the tree was unfinished)."""
        inputs = (roots, h_final, dflash_hidden, cand_ids, cand_logits)
        self._check(inputs)
        if self._graph is None:
            self._first(*inputs)
            self._last_inputs = inputs
        else:
            feed_graph_inputs(self._graph_inputs, inputs, self._aliased)
            self._graph[0].replay()
        return self.finish() if finish else self.result

    @torch.no_grad()
    def finish(self) -> WeaverTrees:
        """The second phase of the last build, for the trees its first phase left unfinished (one host read of
        `truncated`; nothing runs when every tree is finished or R1 = R)."""
        if self.first_rounds < self.rounds and bool(self.truncated.any()):
            if self._graph is None:
                self._second(*self._last_inputs)
            else:
                self._graph[1].replay()
        return self.result

    @torch.no_grad()
    def capture(self, roots: torch.Tensor, h_final: torch.Tensor, dflash_hidden: torch.Tensor,
                cand_ids: torch.Tensor, cand_logits: torch.Tensor, warmup: int = 2, alias: bool = False) -> None:
        """Capture one build's two phases in CUDA graphs (inputs copied into static buffers shaped like these
        examples); later `build` calls copy their inputs there and replay them. `alias`: the graphs read these
        tensors themselves (a caller's fixed buffers), and `build` takes exactly them, with no copy. CUDA only."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA-graph capture needs a CUDA device; on the CPU `build` runs eagerly")
        inputs = (roots, h_final, dflash_hidden, cand_ids, cand_logits)
        self._check(inputs)
        self._graph_inputs = inputs if alias else tuple(t.clone() for t in inputs)
        self._aliased = alias
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):                     # compile kernels and fill the allocator before capture
            for _ in range(warmup):
                self._first(*self._graph_inputs)
                self._second(*self._graph_inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graphs = []
        for phase in (self._first, self._second) if self.first_rounds < self.rounds else (self._first,):
            graphs.append(torch.cuda.CUDAGraph())
            with torch.cuda.graph(graphs[-1]):
                phase(*self._graph_inputs)
        self._graph = (graphs[0], graphs[1] if len(graphs) > 1 else None)

    # ---- one build ---------------------------------------------------------------------------------------
    def _check(self, inputs) -> None:
        roots, h_final, dflash_hidden, cand_ids, cand_logits = inputs
        B, L, K = self.batch, self.L_in, self.K
        want = {"roots": (B,), "h_final": (B, h_final.shape[-1]), "dflash_hidden": (B, L, dflash_hidden.shape[-1]),
                "cand_ids": (B, L, K), "cand_logits": (B, L, K)}
        for (name, shape), t in zip(want.items(), inputs):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")

    @torch.no_grad()
    def _first(self, roots, h_final, dflash_hidden, cand_ids, cand_logits) -> None:
        """The first phase on the static buffers: reset, root step, rounds 1..R1, finish (a fixed op sequence)."""
        self._start(roots, h_final, dflash_hidden, cand_ids, cand_logits)
        self._rounds(1, self.first_rounds, cand_ids)

    @torch.no_grad()
    def _second(self, roots, h_final, dflash_hidden, cand_ids, cand_logits) -> None:
        """The second phase: rounds R1+1..R, finish (a no-op build when R1 = R)."""
        if self.first_rounds < self.rounds:
            self._rounds(self.first_rounds + 1, self.rounds, cand_ids)

    def _start(self, roots, h_final, dflash_hidden, cand_ids, cand_logits) -> None:
        """Reset the buffers, then the root step."""
        self.weaver.prefix(h_final, dflash_hidden[:, :self.L], into=self.state)          # K/V into the state
        self.front_flt[:, :, 0].fill_(-math.inf)                               # empty frontier
        self.slot_int[:, 0, 1].copy_(roots)               # slot 0's parent, depth, score and log q are constant
        self.slot_placed[:, 1:].zero_()                   # slots an earlier build's second phase filled
        self.count.fill_(1)
        root = roots[:, None]                                                  # [B, 1]
        h = self.weaver.step(self.state, root, self.root_depth, None, self.embed_weight,
                             mask=self._step_mask(0, 1))                       # [B, 1, r]
        self.cand_logits.copy_(cand_logits)
        self._push(h, 0, self.root_depth, self.root_active, self.root_score, cand_ids, self.row_base)

    def _rounds(self, first: int, last: int, cand_ids) -> None:
        """Rounds first..last (each a fixed op sequence), then finish: node rows and `truncated`."""
        Wd, R = self.width, self.rounds
        for r in range(first, last + 1):
            s0 = 1 + (r - 1) * Wd                                              # first placement slot of round r
            tok, dep, score, active, rows = self._place(s0, expand=r < R)      # [B, Wd] each
            if r < R:
                h = self.weaver.step(self.state, tok, dep, None, self.embed_weight,
                                     mask=self._step_mask(s0, Wd))             # [B, Wd, r]
                self._push(h, s0, dep, active, score, cand_ids, rows)
        self._finish(active if last == R else None)

    def _step_mask(self, s0: int, width: int) -> torch.Tensor:
        """The attention mask of the step over slots s0 .. s0+width-1: a view [B, 1, width, P0+s0+width] of `mask`
        (the prefix, the slots' ancestors, each slot itself; no launch)."""
        return self.mask[:, s0: s0 + width, : self.state.prefix_len + s0 + width][:, None]

    def _push(self, h, s0: int, dep, active, score, cand_ids, rows) -> None:
        """Children of the W slots of one step into frontier rows N .. N+Wd*E-1: each slot's log q over the
        candidates of its depth (read in place from the [B * L, K] tables), then its top-E (`top_children`'s order)
        as children, in one launch of `tfm_kernels.weaver_frontier` on CUDA.

        h [B, W, r]; dep [B, W] long (< L: a slot at depth L does not expand and has depth 0 here); active [B, W]
        bool (the slot is a node that expands); score [B, W] f64; rows [B, W] long: each slot's candidate row
        b * L + depth (written by `_place`).
        """
        K = self.K
        ids = cand_ids.reshape(-1, K)                                          # [B * L, K]
        logq = self.weaver.score(h, ids, self.cand_logits.view(-1, K), self.lm_head_weight, rows=rows)  # [B, W, K]
        push = fused_push if self.fused_frontier else push_ref
        push(self.front_int, self.front_flt, logq, ids, rows, dep, active, score, s0, self.budget, self.E)

    def _place(self, s0: int, expand: bool):
        """Rank the frontier (a stable sort by score, descending), place the first `width` entries into slots
        s0 .. s0+Wd-1, keep the next `budget`; when `expand`, write the slots' rows of `visible` (a slot sees its
        parent's ancestors, the parent and itself; a slot that does not expand only itself). One launch of
        `tfm_kernels.weaver_frontier` on CUDA (ranking included; as `_push`), its torch reference elsewhere.

        Returns the slots' token and depth [B, Wd] long (0, padding, where the slot does not expand), score [B, Wd]
        f64, active [B, Wd] bool (placed at a depth that still has a candidate row: it expands next step) and the
        candidate row of that depth [B, Wd] long (b * L + depth)."""
        place = fused_place if self.fused_frontier else place_ref
        place(self.front_int, self.front_flt, self.perm, self.slot_int, self.slot_flt, self.slot_placed, self.count,
              self.visible, self.placed_out, s0, self.budget, self.L, expand, self.L_in)
        return self.placed_out

    def _finish(self, last_active) -> None:
        """Placement slots -> node rows; `truncated` where entries or expandable nodes are left (one launch of
        `tfm_kernels.weaver_frontier` on CUDA, its torch reference elsewhere).

        last_active [B, Wd]: round R's slots that would expand (None after an earlier round, whose step pushed
        their children into the frontier)."""
        finish = fused_finish if self.fused_frontier else finish_ref
        finish(self.slot_int, self.slot_flt, self.slot_placed, self.front_flt, last_active,
               (self.tokens, self.parents, self.depths, self.draft_logprobs, self.num_nodes, self.truncated),
               self.budget)


def ancestor_masks(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [B, N] long (-1 at roots and padding) -> [B, N, N] bool, inclusive: row i is True at i and its
    ancestors, for trees at most `max_depth` deep (e.g. the lookahead L), so a padded row of `WeaverTrees` gives its
    padding nodes a row that sees only themselves (as `graphs.pad_tree`). No host reads (capturable in a CUDA graph):
    on CUDA one launch of `tfm_kernels.tree_ancestors`, elsewhere its torch reference (each row follows its parent
    chain `max_depth` steps)."""
    if kernel_device(parents):
        return tree_ancestors(parents, max_depth)
    return ancestors_ref(parents, max_depth)
