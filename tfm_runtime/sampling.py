"""Target filtering and inverse-CDF sampling.

`filter_probs` turns logits into the distribution the target samples from (temperature, then top-k, then
top-p). It is applied once, identically, before every verification rule, so that all rules are lossless with
respect to the same distribution. Sampling always goes through `sample_from_uniform`, so every random
decision in the runtime is one uniform mapped through an inverse CDF, which is what lets the tests replay
and enumerate the verifiers exactly.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Sequence

import torch


def filter_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """logits [..., V] -> probs [..., V], each row summing to 1.

    Args:
        logits: [..., V] raw scores.
        temperature: 0 gives the one-hot argmax (lowest index on ties; top_k / top_p are then irrelevant);
            > 0 gives softmax(logits / temperature).
        top_k: keep the k most likely tokens (ties at the cut go to lower token ids). Default: 0 (off).
        top_p: then keep the smallest most-likely-first set whose (renormalised) mass reaches top_p, at least
            one token. Default: 1.0 (off).
        dtype: output dtype. Default: the logits' dtype, promoted to at least float32.
    Example:
        >>> filter_probs(torch.tensor([2.0, 1.0, 0.0]), 1.0, top_k=2)
        tensor([0.7311, 0.2689, 0.0000])
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    dtype = dtype or torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(dtype)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(dtype)
    probs = torch.softmax(logits / temperature, dim=-1)
    V = probs.shape[-1]
    if (top_k == 0 or top_k >= V) and top_p >= 1.0:
        return probs
    # Work in most-likely-first order; `keep` [..., V] is aligned with that order.
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if 0 < top_k < V:
        keep[..., top_k:] = False
    if top_p < 1.0:
        kept = sorted_p * keep
        kept = kept / kept.sum(-1, keepdim=True)
        # A token stays if the mass strictly before it has not yet reached top_p (the first always stays).
        mass_before = kept.cumsum(-1) - kept
        keep &= mass_before < top_p
        keep[..., 0] = True
    mask = torch.zeros_like(keep).scatter(-1, order, keep)
    probs = probs * mask
    return probs / probs.sum(-1, keepdim=True)


def sample_from_uniform(weights: torch.Tensor | Sequence[float], u: float) -> int:
    """Inverse CDF: weights [K] (>= 0, any positive total; a tensor or a list) and u in [0, 1) -> the index k
    whose cell [cdf[k-1], cdf[k]) / total contains u. A zero-weight index is never returned."""
    if isinstance(weights, torch.Tensor):
        cdf = weights.to(torch.float64).cumsum(0)                                # [K]
        total = float(cdf[-1])
        k = int(torch.searchsorted(cdf, u * total, right=True)) if total > 0.0 else 0
    else:
        cdf = list(itertools.accumulate(float(w) for w in weights))
        total = cdf[-1]
        k = bisect.bisect_right(cdf, u * total)
    if not total > 0.0:
        raise ValueError(f"cannot sample from weights with total mass {total}")
    if k >= len(cdf):
        # u * total rounded up to the total: take the last index that has mass.
        k = max(i for i in range(len(cdf)) if float(weights[i]) > 0.0)
    return k


def uniforms(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """[n] float64 uniforms in [0, 1) on the CPU, drawn from `generator` (on its device)."""
    device = generator.device if generator is not None else "cpu"
    return torch.rand(n, generator=generator, dtype=torch.float64, device=device).cpu()


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """probs [V] -> one token id, by inverse CDF on a single uniform from `generator`."""
    return sample_from_uniform(probs, float(uniforms(1, generator)[0]))
