"""Turn (prompt, response) token sequences into anchor rows: what Weaver training needs, computed once.

For a sequence x_0..x_{T-1} (prompt of P tokens, then the response) and an anchor i (P <= i <= T-2):
  root_token      x_i
  h_final         target final-norm hidden at i-1 (the LM-head input that produced x_i)          [H]
  dflash_hidden   DFlash final hidden at block positions 1..L, context = taps at positions < i   [L, H]
  cand_ids/logits top-K of the DFlash logits per depth (raw logits)                             [L, K]
  true_tokens     x_{i+1..i+L} (-1 past the end)                                                [L]
  target_topk_*   top-k of the target log-softmax at positions i..i+L-1 (teacher forcing)       [L, k]
  loss_mask       depth d has a true token inside the response                                   [L]
"""
from __future__ import annotations

import numpy as np
import torch

from pipelines.collect.inputs import Sample


def sample_anchors(prompt_len: int, seq_len: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """Distinct anchor positions in [max(1, P), T-2], sorted; fewer when the response is short."""
    lo, hi = max(1, prompt_len), seq_len - 2
    if hi < lo:
        return np.zeros(0, dtype=np.int64)
    valid = np.arange(lo, hi + 1)
    pick = rng.choice(valid, size=min(count, valid.size), replace=False)
    return np.sort(pick)


def anchor_rng(seed: int, sample_id: int) -> np.random.Generator:
    return np.random.default_rng([seed, sample_id])


@torch.no_grad()
def featurize(target, drafter, sample: Sample, *, anchors_per_sequence: int, candidate_pool: int,
              target_topk: int, seed: int) -> dict[str, np.ndarray]:
    """One sequence -> columns of its anchor rows (numpy, float tensors as float32; the writer casts)."""
    ids = list(sample.prompt_ids) + list(sample.response_ids)
    P, T = len(sample.prompt_ids), len(ids)
    anchors = sample_anchors(P, T, anchors_per_sequence, anchor_rng(seed, sample.sample_id))
    A, L = anchors.size, drafter.lookahead
    dev = target.device
    seq = torch.tensor(ids, device=dev)
    out = target(seq[None])
    if A == 0:
        return {}
    anc = torch.as_tensor(anchors, device=dev)
    block = torch.full((A, L + 1), drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
    block[:, 0] = seq[anc]
    u = drafter.forward_blocks(out.taps, anc, target.embed(block))[:, 1:]              # [A, L, H]
    d_logits = (u @ target.lm_head_weight.T).float()                                  # [A, L, V]
    K = min(candidate_pool, d_logits.shape[-1])
    cand_logits, cand_ids = d_logits.topk(K, dim=-1)
    pos = anc[:, None] + torch.arange(L, device=dev)                                  # [A, L] predicting x_{pos+1}
    inside = pos + 1 < T
    logp = torch.log_softmax(out.logits[0].float(), dim=-1)                           # [T, V]
    k = min(target_topk, logp.shape[-1])
    t_lp, t_ids = logp[pos.clamp(max=T - 1)].topk(k, dim=-1)                          # [A, L, k]
    t_lp = torch.where(inside[..., None], t_lp, torch.zeros_like(t_lp))
    t_ids = torch.where(inside[..., None], t_ids, torch.full_like(t_ids, -1))
    true = torch.where(inside, seq[(pos + 1).clamp(max=T - 1)], torch.full_like(pos, -1))
    cpu = lambda x: x.detach().cpu().numpy()  # noqa: E731
    return {
        "sample_id": np.full(A, sample.sample_id, dtype=np.int64),
        "anchor_pos": anchors.astype(np.int64),
        "root_token": cpu(seq[anc]).astype(np.int32),
        "h_final": cpu(out.h_final[0, anc - 1].float()),
        "dflash_hidden": cpu(u.float()),
        "cand_ids": cpu(cand_ids).astype(np.int32),
        "cand_logits": cpu(cand_logits),
        "true_tokens": cpu(true).astype(np.int32),
        "target_topk_ids": cpu(t_ids).astype(np.int32),
        "target_topk_logprobs": cpu(t_lp),
        "loss_mask": cpu(inside),
    }


def concat_rows(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    parts = [p for p in parts if p]
    if not parts:
        return {}
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
