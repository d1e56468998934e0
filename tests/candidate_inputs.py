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


def assert_grads_match_float64(fn, hidden, weight, cand, bias, w, dtype, inv_t=None):
    """fn's log-probs and gradients (hidden, bias) against `candidate_logits_ref` under float64 autograd."""
    from tfm_kernels.candidate_logits import candidate_logits_ref

    def ref(h, wt, c, b, inv):
        return candidate_logits_ref(h, wt, c, inv, b)[1]
    lp, dh, db = grads(fn, hidden, weight, cand, bias, w, dtype, inv_t)
    lp_r, dh_r, db_r = grads(ref, hidden, weight, cand, bias, w, torch.float64, inv_t)
    assert torch.equal(torch.isfinite(lp), torch.isfinite(lp_r))
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    fin = torch.isfinite(lp_r)
    assert (lp.double()[fin] - lp_r[fin]).abs().max() < tol
    assert dh.dtype == dtype and db.dtype == torch.float32
    assert (dh.double() - dh_r).abs().max() <= tol * max(1.0, dh_r.abs().max().item())
    assert (db.double() - db_r).abs().max() <= tol
    assert torch.all(db[~fin] == 0), "pads get no gradient"
