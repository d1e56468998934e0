"""Held-out evaluation from shard rows alone: simulated greedy acceptance length of chains and trees.

A row holds the true continuation x_{i+1..i+L} and the target's argmax along it (teacher forcing). Greedy
verification accepts a drafted path while each token equals the target's argmax after the accepted prefix, so
a path is accepted exactly as far as it follows the continuation while the continuation itself is the target's
argmax (always, for greedy rollouts). Acceptance length = accepted draft tokens + 1 (the bonus), as in decoding.
Teacher forcing makes the chain exact too: a greedy chain equals the true continuation up to its first miss.
"""
from __future__ import annotations

import torch

from tfm_runtime.tree import Tree, build_ddtree
from tfm_runtime.weaver_tree import build_weaver_trees


def truth_lengths(true_tokens: torch.Tensor, target_argmax: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] -> [B]: depths of the continuation that greedy verification can accept (leading run of depths
    inside the response where the true token is the target's argmax)."""
    ok = loss_mask & (true_tokens == target_argmax)
    return ok.long().cumprod(-1).sum(-1)


def chain_acceptance(picks: torch.Tensor, true_tokens: torch.Tensor, truth_len: torch.Tensor) -> torch.Tensor:
    """picks [B, L] greedy chain tokens under teacher forcing -> acceptance length [B] (1 + leading hits)."""
    L = picks.shape[-1]
    inside = torch.arange(L, device=picks.device)[None] < truth_len[:, None]
    return 1 + ((picks == true_tokens) & inside).long().cumprod(-1).sum(-1)


def tree_acceptance(tree: Tree, truth: list[int]) -> int:
    """1 + how far the tree contains the path truth[0], truth[1], ... from its root."""
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(tree.tokens)):
        children.setdefault(int(tree.parents[i]), {}).setdefault(int(tree.tokens[i]), i)
    node, n = 0, 1
    for tok in truth:
        node = children.get(node, {}).get(tok)
        if node is None:
            break
        n += 1
    return n


def ddtree_from_candidates(root: int, cand_ids: torch.Tensor, cand_logits: torch.Tensor, budget: int) -> Tree:
    """DDTree over DFlash's top-K per depth, each depth's log-probs normalised over its K candidates (the shards
    hold no full-vocabulary normaliser). Within a depth the ranking is the full vocabulary's; across depths the
    candidates' missing mass lifts deeper paths a little, so the tree can differ from the decoder's DDTree."""
    t = build_ddtree(root, cand_logits.float(), budget)
    tokens = t.tokens.clone()
    tokens[1:] = cand_ids[t.depths[1:] - 1, t.tokens[1:]]
    return Tree(tokens=tokens, parents=t.parents, depths=t.depths, draft_logprobs=t.draft_logprobs)


@torch.no_grad()
def weaver_acceptance(objective, b: dict, logq: torch.Tensor, budgets: list[int]) -> dict[str, float]:
    """Mean simulated acceptance length over the rows of batch `b` (logq [B, L, K] = objective.logq(b), the
    teacher-forced chain): DFlash chain, Weaver chain, and DDTree and Weaver trees at each budget."""
    embed, lm_head, _ = objective.frozen
    weaver = objective.weaver
    truth_len = truth_lengths(b["true_tokens"], b["target_topk_ids"][..., 0], b["loss_mask"])
    pick_w = b["cand_ids"].gather(-1, logq.argmax(-1, keepdim=True))[..., 0]
    pick_d = b["cand_ids"].gather(-1, b["cand_logits"].float().argmax(-1, keepdim=True))[..., 0]
    out = {"accept_chain_dflash": float(chain_acceptance(pick_d, b["true_tokens"], truth_len).float().mean()),
           "accept_chain_weaver": float(chain_acceptance(pick_w, b["true_tokens"], truth_len).float().mean())}
    rows = range(b["root_token"].shape[0])
    truths = [b["true_tokens"][r, :int(truth_len[r])].tolist() for r in rows]
    roots = b["root_token"].tolist()
    for B in budgets:
        dd = [tree_acceptance(ddtree_from_candidates(roots[r], b["cand_ids"][r], b["cand_logits"][r], B), truths[r])
              for r in rows]
        trees = build_weaver_trees(weaver, roots, b["h_final"], b["dflash_hidden"], b["cand_ids"], b["cand_logits"],
                                   B, embed_weight=embed, lm_head_weight=lm_head)     # all rows in lockstep
        wv = [tree_acceptance(t, truths[r]) for r, t in zip(rows, trees)]
        out[f"accept_ddtree_{B}"] = sum(dd) / len(dd)
        out[f"accept_weaver_{B}"] = sum(wv) / len(wv)
    return out
