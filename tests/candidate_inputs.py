"""Inputs and float64-comparable gradients shared by the candidate-scoring kernel tests."""
import math

import torch


def inputs(M, Kc, Dm, V, dtype, pad_frac=0.0, device="cpu", seed=0, out_of_range_frac=0.0):
    """hidden [M, Dm], weight [V, Dm], cand int32 [M, Kc] (pads: -1, and ids >= V when out_of_range_frac),
    bias fp32 [M, Kc] and loss weights w [M, Kc]."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, Dm, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(V, Dm, generator=gen) / math.sqrt(Dm)).to(device=device, dtype=dtype)
    cand = torch.randint(0, V, (M, Kc), generator=gen)
    cand[torch.rand(M, Kc, generator=gen) < pad_frac] = -1
    if out_of_range_frac:
        cand[torch.rand(M, Kc, generator=gen) < out_of_range_frac] = V + 3
    bias = (2 * torch.randn(M, Kc, generator=gen)).to(device)
    w = torch.randn(M, Kc, generator=gen).to(device)             # loss weights: loss = sum(w * logprobs)
    return hidden, weight, cand.to(device=device, dtype=torch.int32), bias, w


def grads(fn, hidden, weight, cand, bias, w, dtype, inv_t=None):
    """(logprobs, d hidden, d bias) of loss = sum over valid entries of w * logprobs, in `dtype`;
    fn(hidden, weight, cand, bias, inv_t) -> logprobs."""
    h = hidden.detach().to(dtype).requires_grad_()
    b = bias.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()  # fp32 bias
    lp = fn(h, weight.detach().to(dtype), cand, b, inv_t)
    valid = torch.isfinite(lp)
    (w.to(lp.dtype) * lp.masked_fill(~valid, 0.0)).sum().backward()
    return lp.detach(), h.grad, b.grad
