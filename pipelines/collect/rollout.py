"""Response regeneration by the target: batched `generate` (left padding), greedy or seeded sampling."""
from __future__ import annotations

import torch


@torch.no_grad()
def regenerate(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, eos_token_id: int,
               pad_token_id: int, batch_size: int, seed: int) -> list[list[int]]:
    """prompts -> responses (each ends at the first EOS, inclusive, or after max_new_tokens).

    Sampling draws from one torch generator seeded with `seed`, so a shard regenerates identically.
    """
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
