"""Response regeneration by the target: `tfm_runtime.rollout.BatchedGenerator` for dense targets (static KV cache,
captured decode step, continuous batching), Hugging Face `generate` for the others (hybrids with GDN layers)."""
from __future__ import annotations

import torch

from tfm_runtime.rollout import BatchedGenerator, unsupported_reason


def fast_generator(model, *, batch_size: int, max_len: int) -> BatchedGenerator | None:
    """A generator to keep across calls of `regenerate` (its cache and captured steps are reused), or None when
    the target is not a supported dense decoder."""
    if unsupported_reason(model) is not None:
        return None
    return BatchedGenerator(model, max_slots=batch_size, max_len=max_len)


@torch.no_grad()
def regenerate(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, eos_token_id: int,
               pad_token_id: int, batch_size: int, seed: int,
               generator: BatchedGenerator | None = None) -> list[list[int]]:
    """prompts -> responses (each ends at the first EOS, inclusive, or after max_new_tokens).

    Dense targets decode `batch_size` sequences at a time with continuous batching (pass `generator` from
    `fast_generator` to reuse one across shards); sampling is seeded per request from (`seed`, prompt index), so a
    shard regenerates identically whatever the batch size. Other targets use HF `generate` on left-padded chunks of
    `batch_size`, sampling from one torch generator seeded with `seed`.
    """
    if not prompts:
        return []
    if generator is None:
        generator = fast_generator(model, batch_size=min(batch_size, len(prompts)),
                                   max_len=max(len(p) for p in prompts) + max_new_tokens)
    if generator is not None:
        return generator.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                  eos_token_id=eos_token_id, seed=seed)
    return hf_regenerate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id, batch_size=batch_size, seed=seed)


@torch.no_grad()
def hf_regenerate(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, eos_token_id: int,
                  pad_token_id: int, batch_size: int, seed: int) -> list[list[int]]:
    """The HF `generate` path of `regenerate` (left padding, chunks of `batch_size`)."""
    dev = next(model.parameters()).device
    out: list[list[int]] = []
    torch.manual_seed(seed)
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s:s + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(chunk):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
            dict(do_sample=False)
        gen = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
                             eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kw)[:, width:].tolist()
        for g in gen:
            resp = g[: g.index(eos_token_id) + 1] if eos_token_id in g else g
            out.append(resp)
    return out
