"""Proposal trees: the `Tree` record and the chain / DDTree builders (docs/method.md §3.1-3.3, §5.4).

A tree of N nodes is four aligned 1-D tensors. Node 0 is the root: the bonus token of the previous round,
already chosen but not yet in the target's KV cache. Every other node is a draft token whose parent comes
earlier (`0 <= parents[i] < i`), so nodes are in topological order and a prefix of the node list is a tree.

    tokens          [N] long    token id of each node
    parents         [N] long    parents[0] = -1
    depths          [N] long    depths[0] = 0, depths[i] = depths[parents[i]] + 1
    draft_logprobs  [N] float   log q of the node's token under its parent's proposal; 0 at the root

Budget convention: `budget` B counts draft (non-root) nodes, so a tree has at most B + 1 nodes.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from tfm_runtime.sampling import filter_probs, sample


@dataclass(frozen=True, eq=False)
class Tree:
    """A proposal tree (see the module docstring for the fields). Invariants are checked on construction.

    Example:
        >>> t = Tree.chain([7, 3, 5])            # root 7, then 3, then 5
        >>> t.path(2), t.children(0), t.positions(10).tolist()
        ([0, 1, 2], [1], [10, 11, 12])
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    draft_logprobs: torch.Tensor
    _children: tuple[tuple[int, ...], ...] = field(init=False, repr=False)
    _parent_list: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self):
        fields = {"tokens": self.tokens, "parents": self.parents, "depths": self.depths,
                  "draft_logprobs": self.draft_logprobs}
        for name, t in fields.items():
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise ValueError(f"Tree.{name} must be a 1-D tensor, got {_describe(t)}")
        n = self.tokens.numel()
        if n == 0:
            raise ValueError("a Tree needs at least the root node, got 0 nodes")
        for name, t in fields.items():
            if t.numel() != n:
                raise ValueError(f"Tree.{name} has {t.numel()} entries, tokens has {n}")
            want_float = name == "draft_logprobs"
            if t.dtype.is_floating_point != want_float or (not want_float and t.dtype != torch.long):
                raise ValueError(f"Tree.{name} must be {'floating' if want_float else 'torch.long'}, got {t.dtype}")

        tokens, parents, depths = self.tokens.tolist(), self.parents.tolist(), self.depths.tolist()
        if parents[0] != -1 or depths[0] != 0:
            raise ValueError(f"the root must have parent -1 and depth 0, got parent {parents[0]}, depth {depths[0]}")
        if min(tokens) < 0:
            raise ValueError(f"token ids must be >= 0, got {min(tokens)}")
        if bool(torch.isnan(self.draft_logprobs).any()):
            raise ValueError("Tree.draft_logprobs contains NaN")
        children: list[list[int]] = [[] for _ in range(n)]
        seen: set[tuple[int, int]] = set()
        for i in range(1, n):
            p = parents[i]
            if not 0 <= p < i:
                raise ValueError(f"parents must be topological (0 <= parents[i] < i), got parents[{i}] = {p}")
            if depths[i] != depths[p] + 1:
                raise ValueError(f"depths[{i}] = {depths[i]} but its parent {p} has depth {depths[p]}")
            if (p, tokens[i]) in seen:
                raise ValueError(f"duplicate sibling token {tokens[i]} under parent {p} (node {i})")
            seen.add((p, tokens[i]))
            children[p].append(i)
        object.__setattr__(self, "_children", tuple(tuple(c) for c in children))
        object.__setattr__(self, "_parent_list", tuple(parents))

    @classmethod
    def chain(cls, tokens, logprobs=None) -> "Tree":
        """tokens [N] (root first), logprobs [N] (root 0; default all 0) -> the chain root -> ... -> tokens[N-1]."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        n = tokens.numel()
        if logprobs is None:
            logprobs = torch.zeros(n, device=tokens.device)
        logprobs = torch.as_tensor(logprobs, device=tokens.device)
        if not logprobs.dtype.is_floating_point:
            logprobs = logprobs.float()
        steps = torch.arange(n, device=tokens.device)
        return cls(tokens=tokens, parents=steps - 1, depths=steps, draft_logprobs=logprobs)

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self._parent_list))

    def children(self, i: int) -> list[int]:
        """Child node indices of node i, in increasing order."""
        return list(self._children[i])

    def path(self, i: int) -> list[int]:
        """Node indices root .. i."""
        out = [i]
        while self._parent_list[out[-1]] >= 0:
            out.append(self._parent_list[out[-1]])
        return out[::-1]

    def positions(self, start: int) -> torch.Tensor:
        """[N] long: the sequence position of every node when the root sits at `start`."""
        return start + self.depths

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool, inclusive: row i is True exactly at the nodes of path(i), i itself included."""
        n = self.num_nodes
        rows = torch.arange(n, device=self.parents.device)
        mask = torch.zeros(n, n, dtype=torch.bool, device=self.parents.device)
        # Walk every node up one level per round: `up` [N] is the ancestor reached so far (-1 past the root).
        up = rows.clone()
        for _ in range(int(self.depths.max()) + 1):
            live = up >= 0
            mask[rows[live], up[live]] = True
            up = torch.where(live, self.parents[up.clamp_min(0)], up)
        return mask

    def to(self, device) -> "Tree":
        return Tree(tokens=self.tokens.to(device), parents=self.parents.to(device), depths=self.depths.to(device),
                    draft_logprobs=self.draft_logprobs.to(device))


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _check_builder_args(draft_logits: torch.Tensor, budget: int) -> None:
    if not isinstance(draft_logits, torch.Tensor) or draft_logits.dim() != 2:
        raise ValueError(f"draft_logits must be [L, V], got {_describe(draft_logits)}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")


def build_chain(root_token: int, draft_logits: torch.Tensor, budget: int, *, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[Tree, torch.Tensor | None]:
    """A chain of min(budget, L) draft tokens, the depth-d token drawn from draft_logits[d - 1].

    Args:
        root_token: the bonus token (node 0).
        draft_logits: [L, V] drafter logits for depths 1..L.
        budget: number of draft nodes wanted.
        temperature: 0 takes the argmax (lowest index on ties); > 0 samples from softmax(logits / T).
        generator: random source for T > 0.
    Returns:
        tree: a chain Tree with N = min(budget, L) + 1 nodes. draft_logprobs = log-softmax of the chosen token
            (of logits / T when T > 0, i.e. log q of the proposal actually used).
        draft_probs: None when T == 0; else [N, V] where row i is the proposal q that node i + 1 was drawn
            from, and the last row is zero (the last node proposes nothing). This is what
            `verify_chain_sampling` needs.
    """
    _check_builder_args(draft_logits, budget)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    n = min(budget, draft_logits.shape[0])
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    logits = draft_logits[:n].to(dtype)                                          # [n, V]
    depth = torch.arange(n, device=logits.device)
    if temperature == 0:
        toks = logits.argmax(-1)                                                  # [n]
        logq = torch.log_softmax(logits, -1)[depth, toks]
        draft_probs = None
    else:
        q = filter_probs(logits, temperature)                                     # [n, V]
        toks = torch.tensor([sample(q[d], generator) for d in range(n)], dtype=torch.long, device=logits.device)
        logq = q[depth, toks].log()
        draft_probs = torch.cat([q, q.new_zeros(1, q.shape[-1])])                 # [n + 1, V]
    root = torch.tensor([root_token], dtype=torch.long, device=logits.device)
    tree = Tree.chain(torch.cat([root, toks]), torch.cat([logq.new_zeros(1), logq]))
    return tree, draft_probs


def top_k_stable(x: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """The first k of a stable descending sort of each row (equal values in index order, so trees are
    deterministic), as lists: x [L, V] -> (values [L][k], indices [L][k]). Sorts only the entries at or above each
    row's k-th largest value instead of all V."""
    if k >= x.shape[-1]:
        v, i = x.sort(dim=-1, descending=True, stable=True)
        return v.tolist(), i.tolist()
    kth = x.topk(k, dim=-1).values[:, -1:]                                       # [L, 1]
    values, indices = [], []
    for row, t in zip(x, kth):
        idx = (row >= t).nonzero()[:, 0]                                          # >= k entries, in index order
        v, order = row[idx].sort(descending=True, stable=True)
        values.append(v[:k].tolist())
        indices.append(idx[order[:k]].tolist())
    return values, indices


def build_ddtree(root_token: int, draft_logits: torch.Tensor, budget: int) -> Tree:
    """DDTree: the `budget` most likely paths under the product of independent per-depth marginals.

    Best-first search over the top-k (k = min(budget, V)) tokens of every depth (docs/method.md §3.3): a heap entry is
    a path given by its per-depth ranks; popping it creates its node and pushes its next sibling (rank + 1)
    and its first child (rank 0 one level deeper). Path scores only decrease along a path, so the result is
    ancestor-closed and nodes come out parents first. Ties go to the lexicographically smaller rank path
    (ranks among equal log-probs are by token id). Zero-probability (-inf) paths are never placed, so the
    tree has fewer than budget + 1 nodes only when fewer positive-probability paths exist.

    Args:
        root_token: the bonus token (node 0).
        draft_logits: [L, V] drafter logits for depths 1..L.
        budget: number of draft nodes wanted.
    Returns:
        Tree with min(budget, #paths) + 1 nodes; draft_logprobs[i] = log-softmax of node i's token at its depth.
    """
    _check_builder_args(draft_logits, budget)
    L, V = draft_logits.shape
    tokens, parents, depths, logq = [int(root_token)], [-1], [0], [0.0]
    k = min(budget, V)
    if k > 0 and L > 0:
        logp = torch.log_softmax(draft_logits.to(torch.promote_types(draft_logits.dtype, torch.float32)), -1)
        if torch.isnan(logp).any():
            raise ValueError("draft_logits hold NaN: the drafter's block is corrupt (no tree can rank it)")
        top_lp, top_tok = top_k_stable(logp, k)          # [L][k]: equal log-probs in token order
        # (-score, ranks, parent node, parent score); ranks[d] = rank of the token at depth d + 1
        heap = [(-top_lp[0][0], (0,), 0, 0.0)]
        while heap and len(tokens) <= budget:
            neg_score, ranks, parent, parent_score = heapq.heappop(heap)
            if neg_score == float("inf"):
                break
            depth, rank, score = len(ranks), ranks[-1], -neg_score
            node = len(tokens)
            tokens.append(top_tok[depth - 1][rank]), parents.append(parent), depths.append(depth)
            logq.append(top_lp[depth - 1][rank])
            if rank + 1 < k:
                sib = parent_score + top_lp[depth - 1][rank + 1]
                heapq.heappush(heap, (-sib, ranks[:-1] + (rank + 1,), parent, parent_score))
            if depth < L:
                heapq.heappush(heap, (-(score + top_lp[depth][0]), ranks + (0,), node, score))
    device = draft_logits.device
    return Tree(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                parents=torch.tensor(parents, dtype=torch.long, device=device),
                depths=torch.tensor(depths, dtype=torch.long, device=device),
                draft_logprobs=torch.tensor(logq, dtype=torch.float64, device=device))


def __getattr__(name: str):
    """`tfm_runtime.tree.build_weaver_tree`: the Weaver builder lives in tfm_runtime/weaver_tree.py (which
    imports this module, so it is re-exported lazily)."""
    if name == "build_weaver_tree":
        from tfm_runtime.weaver_tree import build_weaver_tree
        return build_weaver_tree
    raise AttributeError(f"module 'tfm_runtime.tree' has no attribute {name!r}")
