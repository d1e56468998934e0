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
from tfm_runtime.models.dflash import dflash_candidates


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
    """One sequence -> columns of its anchor rows (see `featurize_batch`)."""
    return featurize_batch(target, drafter, [sample], anchors_per_sequence=anchors_per_sequence,
                           candidate_pool=candidate_pool, target_topk=target_topk, seed=seed)


def token_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups of sequence indices whose padded size (count x longest) stays within max_tokens."""
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(n, longest) <= max_tokens:
            groups[-1].append(i)
            longest = max(n, longest)
        else:
            groups.append([i])
            longest = n
    return groups


@torch.no_grad()
def featurize_batch(target, drafter, samples: list[Sample], *, anchors_per_sequence: int, candidate_pool: int,
                    target_topk: int, seed: int, max_tokens: int = 16384,
                    topk_chunk: int = 64) -> dict[str, np.ndarray]:
    """Sequences -> columns of their anchor rows (numpy, float tensors as float32; the writer casts), in the order
    of `samples`, then of the anchors. Sequences go through the target right-padded, up to `max_tokens` padded
    tokens per forward (causal attention: padding after a sequence never reaches its positions); the LM head runs
    only at the positions the rows need, and the DFlash top-K over `topk_chunk` anchors at a time."""
    parts = []
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    for group in token_batches(lengths, max_tokens):
        parts.append(_featurize_group(target, drafter, [samples[i] for i in group], anchors_per_sequence,
                                      candidate_pool, target_topk, seed, topk_chunk))
    return concat_rows(parts)


def _featurize_group(target, drafter, samples, anchors_per_sequence, candidate_pool, target_topk, seed, topk_chunk):
    dev, L = target.device, drafter.lookahead
    seqs = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
    anchors = [sample_anchors(len(s.prompt_ids), len(x), anchors_per_sequence, anchor_rng(seed, s.sample_id))
               for s, x in zip(samples, seqs)]
    if not sum(a.size for a in anchors):
        return {}
    Tmax = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), Tmax, dtype=torch.long)
    for b, x in enumerate(seqs):
        ids[b, :len(x)] = torch.tensor(x)
    ids = ids.to(dev)
    out = target(ids, logits=False)                                                   # taps, h_final [B, Tmax, *]
    b_of = torch.cat([torch.full((a.size,), b, dtype=torch.long) for b, a in enumerate(anchors)]).to(dev)  # [A]
    anc = torch.as_tensor(np.concatenate(anchors), device=dev)                       # [A]
    T = torch.as_tensor([len(x) for x in seqs], device=dev)[b_of]                    # [A] own sequence length
    block = torch.full((anc.numel(), L + 1), drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
    block[:, 0] = ids[b_of, anc]
    u = drafter.forward_blocks(out.taps, anc, target.embed(block), seq_index=b_of)[:, 1:]   # [A, L, H]
    pos = anc[:, None] + torch.arange(L, device=dev)                                  # [A, L] predicting x_{pos+1}
    inside = pos + 1 < T[:, None]
    posc = torch.minimum(pos, T[:, None] - 1)
    K = min(candidate_pool, target.vocab_size)
    k = min(target_topk, target.vocab_size)
    cand_ids, cand_logits = dflash_candidates(u, target.lm_head_weight, K, topk_chunk)    # [A, L, K]
    t_lp, t_ids = [], []
    for i in range(0, anc.numel(), topk_chunk):
        sl = slice(i, i + topk_chunk)
        logp = torch.log_softmax(target.head(out.h_final[b_of[sl, None], posc[sl]]).float(), dim=-1)  # [a, L, V]
        v, j = logp.topk(k, dim=-1)                                                    # [a, L, k]
        t_lp.append(v), t_ids.append(j)
    t_lp, t_ids = torch.cat(t_lp), torch.cat(t_ids)
    t_lp = torch.where(inside[..., None], t_lp, torch.zeros_like(t_lp))
    t_ids = torch.where(inside[..., None], t_ids, torch.full_like(t_ids, -1))
    true = torch.where(inside, ids[b_of[:, None], (pos + 1).clamp(max=Tmax - 1)], torch.full_like(pos, -1))
    cpu = lambda x: x.detach().cpu().numpy()  # noqa: E731
    return {
        "sample_id": np.concatenate([np.full(a.size, s.sample_id, dtype=np.int64) for s, a in zip(samples, anchors)]),
        "anchor_pos": cpu(anc).astype(np.int64),
        "root_token": cpu(ids[b_of, anc]).astype(np.int32),
        "h_final": cpu(out.h_final[b_of, anc - 1].float()),
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
