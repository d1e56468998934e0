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
    L, K = cand_ids.shape
    if dflash_hidden.shape[0] != L:
        raise ValueError(f"dflash_hidden has {dflash_hidden.shape[0]} depths, cand_ids has {L}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    L = min(L, weaver.cfg.lookahead)
    width = width or max(1, math.ceil(budget / 16))
    dev = h_final.device
    state = weaver.prefix(h_final[None], dflash_hidden[None, :L])

    tokens, parents, depths, logq, score = [int(root_token)], [-1], [0], [0.0], [0.0]
    anc_slots: list[list[int]] = [[]]        # Weaver K/V slots of each node's strict ancestors
    slot: dict[int, int] = {}                # node -> its K/V slot (only expanded nodes have one)
    frontier: list[tuple[float, int, int, int, float]] = []   # (-score, order, parent, token, local log q)
    order = 0

    def grow(nodes: list[int]) -> None:
        nonlocal order
        nodes = [n for n in nodes if depths[n] < L]          # a depth-L node has no candidate row left
        if not nodes:
            return
        nt = state.num_nodes
        vis = torch.zeros(1, len(nodes), nt, dtype=torch.bool, device=dev)
        for w, n in enumerate(nodes):
            vis[0, w, anc_slots[n]] = True
        tok = torch.tensor([[tokens[n] for n in nodes]], device=dev)
        dep = torch.tensor([[depths[n] for n in nodes]], device=dev)
        h = weaver.step(state, tok, dep, vis, embed_weight)[0]                    # [W, r]
        rows = dep[0]                                                             # children use row = depth
        top = weaver.score(h, cand_ids[rows], cand_logits[rows], lm_head_weight).topk(min(expand, K), dim=-1)
        for w, n in enumerate(nodes):
            slot[n] = nt + w
            for lp, c in zip(top.values[w].tolist(), top.indices[w].tolist()):
                if lp == float("-inf"):
                    continue
                order += 1
                heapq.heappush(frontier, (-(score[n] + lp), order, n, int(cand_ids[rows[w], c]), lp))

    grow([0])
    while len(tokens) <= budget and frontier:
        batch = []
        while frontier and len(batch) < width and len(tokens) <= budget:
            neg, _, parent, tok, lp = heapq.heappop(frontier)
            tokens.append(tok), parents.append(parent), depths.append(depths[parent] + 1)
            logq.append(lp), score.append(-neg)
            anc_slots.append(anc_slots[parent] + [slot[parent]])
            batch.append(len(tokens) - 1)
        if len(tokens) <= budget:
            grow(batch)
    return Tree(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long),
                depths=torch.tensor(depths, dtype=torch.long), draft_logprobs=torch.tensor(logq, dtype=torch.float64))
