"""The batched rollout engine (tfm_runtime.rollout) against Hugging Face on the same prompts, greedy, EOS off:

    report = compare_with_hf(model, prompts, max_new_tokens=64, reference=model_copy_in_higher_precision)

- tokens: `BatchedGenerator.generate` against HF `generate`: the fraction of identical outputs, the mean common
  prefix and the positions of the first divergences (`first_divergence`).
- first logits: `BatchedGenerator.prompt_logits` (the engine's prefill) and HF's forward, each against `reference`
  (the same weights in a higher precision: float64 for a float32 model, float32 for bfloat16). `within_rounding`:
  the engine's error is at most FIRST_LOGITS_FACTOR times HF's own.
- every first divergence: on the common prefix the reference's logits of the two tokens (the engine's, HF's) differ
  by `margin`, and HF's rounding error there is `noise` (the largest |HF - reference| over the vocabulary). Both
  engines err by about `noise`, so rounding can swap two tokens only when margin <= TIE_FACTOR * noise (`rounding`);
  a wrong position, mask or scale gives margins of the size of the logits themselves.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tfm_runtime.rollout import BatchedGenerator

FIRST_LOGITS_FACTOR = 3.0
TIE_FACTOR = 4.0


@torch.no_grad()
def hf_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int = 1) -> list[list[int]]:
    """HF greedy `generate`, exactly `max_new_tokens` per prompt (EOS off, no penalties). `batch_size` 1 runs each
    prompt alone (no padding); larger batches are left-padded with an attention mask."""
    from transformers import GenerationConfig
    saved = model.generation_config
    model.generation_config = GenerationConfig(do_sample=False, pad_token_id=0)      # plain greedy, no EOS
    try:
        out = []
        for i in range(0, len(prompts), batch_size):
            batch = [list(p) for p in prompts[i:i + batch_size]]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens)
            out += gen[:, width:].tolist()
    finally:
        model.generation_config = saved
    return out


@torch.no_grad()
def last_logits(model, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """HF forward over each sequence alone: the logits after its last token, [n, V] float64 on the CPU."""
    rows = [model(torch.tensor([list(s)], device=model.device)).logits[0, -1] for s in sequences]
    return torch.stack(rows).double().cpu()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_with_hf(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, reference,
                    engine: dict | None = None, hf_batch: int = 1) -> dict:
    """The report described in the module docstring (JSON-ready). `model`: an HF causal LM the engine supports;
    `reference`: the same weights in a higher precision, on any device; `engine`: BatchedGenerator keyword
    arguments; `hf_batch`: prompts per HF generate call."""
    prompts = [list(map(int, p)) for p in prompts]
    gen = BatchedGenerator(model, **(engine or {}))
    ours = gen.generate(prompts, max_new_tokens=max_new_tokens)
    stats = dict(gen.stats)
    theirs = hf_generate(model, prompts, max_new_tokens, batch_size=hf_batch)
    dtype = gen.dtype

    ref = last_logits(reference, prompts)
    eng, hf = gen.prompt_logits(prompts).double().cpu(), last_logits(model, prompts)
    scale = float(ref.abs().max())
    floor = torch.finfo(dtype).eps * scale                       # two roundings of the largest logit
    e_err, h_err = float((eng - ref).abs().max()), float((hf - ref).abs().max())
    first = {"engine_vs_reference": e_err, "hf_vs_reference": h_err, "engine_vs_hf": float((eng - hf).abs().max()),
             "reference_scale": scale, "within_rounding": e_err <= FIRST_LOGITS_FACTOR * h_err + floor}

    prefixes = [common_prefix(a, b) for a, b in zip(ours, theirs)]
    parted = [i for i, d in enumerate(prefixes) if d < max_new_tokens]
    divergences = []
    if parted:
        seqs = [prompts[i] + ours[i][:prefixes[i]] for i in parted]
        r, m = last_logits(reference, seqs), last_logits(model, seqs)
        for i, rr, mm in zip(parted, r, m):
            d = prefixes[i]
            a, b = ours[i][d], theirs[i][d]
            margin, noise = float((rr[a] - rr[b]).abs()), float((mm - rr).abs().max())
            divergences.append({"prompt": i, "position": d, "engine_token": a, "hf_token": b, "margin": margin,
                                "noise": noise, "rounding": margin <= TIE_FACTOR * noise + floor})
    positions = sorted(x["position"] for x in divergences)
    return {
        "dtype": str(dtype), "reference_dtype": str(next(reference.parameters()).dtype), "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "identical": 1 - len(parted) / max(1, len(prompts)),
        "mean_common_prefix": sum(prefixes) / max(1, len(prefixes)),
        "first_divergence": {"count": len(positions), "positions": positions, "quantiles": _quantiles(positions)},
        "first_logits": first,
        "explained_by_rounding": sum(x["rounding"] for x in divergences) / len(divergences) if divergences else 1.0,
        "worst_margin_over_noise": max((x["margin"] / max(x["noise"], 1e-30) for x in divergences), default=0.0),
        "divergences": divergences,
        "engine_stats": stats,
    }


def _quantiles(values: list[int]) -> dict:
    if not values:
        return {}
    return {f"p{q}": values[min(len(values) - 1, int(q / 100 * len(values)))] for q in (10, 25, 50, 75, 90)}
