"""Best-first proposal trees with batched Weaver expansions (docs/method.md §3.4).

  root (depth 0, the bonus token): one Weaver step -> top-`expand` children, score = log q
  repeat until `budget` draft nodes are placed:
      take the `width` frontier entries with the highest cumulative score (sum of log q along the path),
      place them as nodes, run ONE batched Weaver step for them (prefix + ancestors + self),
      push each node's top-`expand` children (candidates of row = depth, children deeper than L are invalid)
Nodes are numbered in placement order, so parents precede children. The tree is deterministic; at T > 0 the
verifier (traversal) draws the sibling order from q = softmax(draft_logprobs of the retained siblings).
"""
from __future__ import annotations

import heapq
import math

import torch

from tfm_runtime.models.weaver import Weaver
from tfm_runtime.tree import Tree


@torch.no_grad()
def build_weaver_tree(weaver: Weaver, root_token: int, h_final: torch.Tensor, dflash_hidden: torch.Tensor,
                      cand_ids: torch.Tensor, cand_logits: torch.Tensor, budget: int, *,
                      embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, expand: int = 8,
                      width: int | None = None) -> Tree:
    """h_final [H]; dflash_hidden [L, H]; cand_ids/cand_logits [L, K] (DFlash top-K, raw logits) -> Tree.

    `budget` = number of draft nodes (the tree has at most budget + 1 nodes). `width` = nodes expanded per
    Weaver call (default ceil(budget / 16), as the authors).
    """
    if dflash_hidden.shape[0] != cand_ids.shape[0]:
        raise ValueError(f"dflash_hidden has {dflash_hidden.shape[0]} depths, cand_ids has {cand_ids.shape[0]}")
    return build_weaver_trees(weaver, [root_token], h_final[None], dflash_hidden[None], cand_ids[None],
                              cand_logits[None], budget, embed_weight=embed_weight, lm_head_weight=lm_head_weight,
                              expand=expand, width=width)[0]


class _Growing:
    """One tree under construction: nodes in placement order and the frontier of scored candidates."""

    def __init__(self, root_token: int):
        self.tokens, self.parents, self.depths = [int(root_token)], [-1], [0]
        self.logq, self.score = [0.0], [0.0]
        self.anc_slots: list[list[int]] = [[]]      # Weaver K/V slots of each node's strict ancestors
        self.slot: dict[int, int] = {}              # node -> its K/V slot (only expanded nodes have one)
        self.frontier: list[tuple[float, int, int, int, float]] = []   # (-score, order, parent, token, log q)
        self.order = 0

    def place(self, width: int, budget: int) -> list[int]:
        """Pop up to `width` best frontier entries into nodes -> the new nodes to expand (none once full)."""
        batch = []
        while self.frontier and len(batch) < width and len(self.tokens) <= budget:
            neg, _, parent, tok, lp = heapq.heappop(self.frontier)
            self.tokens.append(tok), self.parents.append(parent), self.depths.append(self.depths[parent] + 1)
            self.logq.append(lp), self.score.append(-neg)
            self.anc_slots.append(self.anc_slots[parent] + [self.slot[parent]])
            batch.append(len(self.tokens) - 1)
        return batch if len(self.tokens) <= budget else []

    def tree(self) -> Tree:
        return Tree(tokens=torch.tensor(self.tokens, dtype=torch.long),
                    parents=torch.tensor(self.parents, dtype=torch.long),
                    depths=torch.tensor(self.depths, dtype=torch.long),
                    draft_logprobs=torch.tensor(self.logq, dtype=torch.float64))


@torch.no_grad()
def top_children(logq: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n children a Weaver node offers: the n best of logq [..., K] and their candidate positions [..., n], in a
    stable descending sort (equal values in candidate order; NaN first, as torch sorts it), the order the fast
    builder's push kernel picks them in."""
    order = torch.sort(logq, dim=-1, descending=True, stable=True).indices[..., :n]     # [..., n]
    return logq.gather(-1, order), order


def step_width(budget: int, steps: int = 16) -> int:
    """Nodes per Weaver step for a tree of `budget` nodes built in about `steps` steps: ceil(budget / steps), at
    least 1 (16 steps: the authors' default width)."""
    return max(1, math.ceil(budget / steps))


def build_weaver_trees(weaver: Weaver, roots: list[int], h_final: torch.Tensor, dflash_hidden: torch.Tensor,
                       cand_ids: torch.Tensor, cand_logits: torch.Tensor, budget: int, *,
                       embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, expand: int = 8,
                       width: int | None = None) -> list[Tree]:
    """B independent trees grown in lockstep, one batched Weaver step per round for all of them (each tree is
    the one `build_weaver_tree` builds for its root): roots B ints; h_final [B, H]; dflash_hidden [B, L, H];
    cand_ids/cand_logits [B, L, K] -> B Trees. A tree with fewer nodes to expand in a round gets padding
    entries that no node ever sees."""
    B, L, K = cand_ids.shape
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    L = min(L, weaver.cfg.lookahead)
    width = width or step_width(budget)
    dev = h_final.device
    state = weaver.prefix(h_final, dflash_hidden[:, :L])
    trees = [_Growing(r) for r in roots]
    batch_index = torch.arange(B, device=dev)[:, None]

    def grow(batches: list[list[int]]) -> None:
        nodes = [[n for n in b if t.depths[n] < L] for t, b in zip(trees, batches)]   # depth L: no row left
        W = max(len(ns) for ns in nodes)
        if W == 0:
            return
        nt = state.num_nodes
        vis = torch.zeros(B, W, nt, dtype=torch.bool)
        tok = torch.zeros(B, W, dtype=torch.long)
        dep = torch.zeros(B, W, dtype=torch.long)
        for b, (t, ns) in enumerate(zip(trees, nodes)):
            for w, n in enumerate(ns):
                vis[b, w, t.anc_slots[n]] = True
                tok[b, w], dep[b, w] = t.tokens[n], t.depths[n]
        tok, dep = tok.to(dev), dep.to(dev)
        h = weaver.step(state, tok, dep, vis.to(dev), embed_weight)                  # [B, W, r]
        ids = cand_ids[batch_index, dep]                                              # [B, W, K] (row = depth)
        values, order = top_children(weaver.score(h, ids, cand_logits[batch_index, dep], lm_head_weight),
                                     min(expand, K))
        vals, toks = values.tolist(), ids.gather(-1, order).tolist()
        for b, (t, ns) in enumerate(zip(trees, nodes)):
            for w, n in enumerate(ns):
                t.slot[n] = nt + w
                for lp, c in zip(vals[b][w], toks[b][w]):
                    if lp == float("-inf"):
                        continue
                    t.order += 1
                    heapq.heappush(t.frontier, (-(t.score[n] + lp), t.order, n, c, lp))

    grow([[0]] * B)
    while True:
        batches = [t.place(width, budget) for t in trees]
        if not any(batches):
            break
        grow(batches)
    return [t.tree() for t in trees]
