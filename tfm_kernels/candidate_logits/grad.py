"""Differentiable candidate log-probs for training: the forward kernel of `triton.py`, and a backward that
gathers the same LM-head rows again instead of keeping a [M, Kc, Dm] copy of them.

    logprobs[m, c] = log_softmax_c( (hidden[m] . weight[cand[m, c]]) * inv_t + bias[m, c] )
    dlogits[m, c]  = g[m, c] - p[m, c] * sum_c' g[m, c']              (p = exp(logprobs); 0 at pads)
    dhidden[m]     = inv_t * sum_c dlogits[m, c] * weight[cand[m, c]]  (`candidate_hidden_grad_kernel`)
    dbias          = dlogits

`weight` is frozen (a target's LM head): it gets no gradient. Both passes read M*Kc*Dm weight elements
once (memory bound, no Kc x Dm intermediate), where `weight[cand]` + bmm writes and re-reads a
[M, Kc, Dm] copy and keeps it alive until the backward.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton import candidate_logits


@triton.jit
def grad_weight_tile(dlogits, weight, ids, i_m, o_c, o_d, m_d, s_wv, Kc, V):
    """dlogits[m, o_c] [BC] and the weight rows of ids (int64, the candidates at o_c) over columns o_d
    [BC, BD]; zero past Kc, at pads (ids < 0 or >= V) and past Dm (~m_d)."""
    valid = (o_c < Kc) & (ids >= 0) & (ids < V)
    b_g = tl.load(dlogits + i_m * Kc + o_c, mask=valid, other=0.0)
    b_w = tl.load(weight + tl.where(valid, ids, 0)[:, None] * s_wv + o_d[None, :],
                  mask=valid[:, None] & m_d[None, :], other=0.0)
    return b_g, b_w


@triton.jit
def candidate_hidden_grad_kernel(
    dlogits, weight, cand, dhidden, s_wv, s_cm, Kc, Dm, V, inv_t,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dhidden[m, d-block] = inv_t * sum_c dlogits[m, c] * weight[cand[m, c], d-block].

    Grid (M, cdiv(Dm, BLOCK_D)). dlogits: fp32 [M, Kc]; weight: [Vocab, Dm]; cand: int [M, Kc]
    (pads < 0 or >= Vocab are skipped); dhidden: [M, Dm].
    """
    i_m, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < Dm
    acc = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    o_c = tl.arange(0, BLOCK_C)
    for c0 in range(0, Kc, BLOCK_C):
        ids = tl.load(cand + i_m * s_cm + c0 + o_c, mask=c0 + o_c < Kc, other=-1).to(tl.int64)
        b_g, b_w = grad_weight_tile(dlogits, weight, ids, i_m, c0 + o_c, o_d, m_d, s_wv, Kc, V)  # [BC], [BC, BD]
        acc += b_w.to(tl.float32) * b_g[:, None]
    b_dh = tl.sum(acc, 0) * inv_t
    tl.store(dhidden + i_m * Dm + o_d, b_dh.to(dhidden.dtype.element_ty), mask=m_d)


@dataclass(frozen=True)
class HiddenGradTuning:
    """Launch parameters of `candidate_hidden_grad`; `HiddenGradTuning.for_shape(Kc, Dm)` is the default.

    block_c: candidates per step of the Kc loop; block_d: hidden columns per program (both powers of 2);
    num_warps, num_stages: launch options.
    """
    block_c: int
    block_d: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("block_c", "block_d"):
            x = getattr(self, name)
            if x < 1 or x & (x - 1):
                raise ValueError(f"{name} must be a power of 2, got {x}")

    @classmethod
    def for_shape(cls, Kc: int, Dm: int) -> "HiddenGradTuning":
        """The default for Kc candidates per row over hidden size Dm: 8 candidates x 512 columns per step."""
        return cls(block_c=min(8, max(2, triton.next_power_of_2(Kc))),
                   block_d=min(512, max(16, triton.next_power_of_2(Dm))), num_warps=4, num_stages=3)


def candidate_hidden_grad(dlogits: torch.Tensor, weight: torch.Tensor, cand: torch.Tensor, inv_t: float,
                          out_dtype: torch.dtype, tuning: HiddenGradTuning | None = None) -> torch.Tensor:
    """dlogits fp32 [M, Kc], weight [Vocab, Dm], cand int [M, Kc] -> dhidden [M, Dm] in out_dtype.

    `tuning`: launch parameters. Default: `HiddenGradTuning.for_shape(Kc, Dm)`.
    """
    M, Kc = dlogits.shape
    Dm = weight.shape[1]
    dhidden = torch.empty(M, Dm, dtype=out_dtype, device=dlogits.device)
    if M == 0:
        return dhidden
    tuning = HiddenGradTuning.for_shape(Kc, Dm) if tuning is None else tuning
    if not isinstance(tuning, HiddenGradTuning):
        raise TypeError(f"tuning must be a HiddenGradTuning, got {type(tuning).__name__}")
    candidate_hidden_grad_kernel[(M, triton.cdiv(Dm, tuning.block_d))](
        dlogits, weight, cand, dhidden, weight.stride(0), cand.stride(0), Kc, Dm, weight.shape[0], float(inv_t),
        BLOCK_C=tuning.block_c, BLOCK_D=tuning.block_d, num_warps=tuning.num_warps, num_stages=tuning.num_stages)
    return dhidden


class _CandidateLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, cand, bias, inv_t):
        _, logprobs = candidate_logits(hidden, weight, cand, inv_temperature=inv_t, bias=bias)
        ctx.save_for_backward(weight, cand, logprobs)
        ctx.inv_t, ctx.hidden_dtype = inv_t, hidden.dtype
        return logprobs

    @staticmethod
    def backward(ctx, g):
        weight, cand, logprobs = ctx.saved_tensors
        valid = torch.isfinite(logprobs)                                                # [M, Kc]
        g = torch.where(valid, g.float(), 0.0)
        dlogits = g - torch.exp(logprobs) * g.sum(-1, keepdim=True)                     # exp(-inf) = 0 at pads
        dhidden = None
        if ctx.needs_input_grad[0]:
            dhidden = candidate_hidden_grad(dlogits.contiguous(), weight, cand, 1.0 if ctx.inv_t is None else ctx.inv_t,
                                            ctx.hidden_dtype)
        dbias = dlogits if ctx.needs_input_grad[3] else None
        return dhidden, None, None, dbias, None


def candidate_log_probs(hidden: torch.Tensor, weight: torch.Tensor, cand: torch.Tensor,
                        bias: torch.Tensor | None = None, inv_temperature: float | None = None) -> torch.Tensor:
    r"""Differentiable log-softmax over candidate LM-head rows (gradients for `hidden` and `bias`).

    Args:
        hidden: [M, Dm] fp16 / bf16 / fp32, one query per row.
        weight: [Vocab, Dm], frozen LM-head rows (must not require grad).
        cand: int32 / int64 [M, Kc]; ids < 0 or >= Vocab are pads (-inf, no gradient).
        bias: fp32 [M, Kc] or None, added after the temperature (Weaver: DFlash logits).
        inv_temperature: None (= 1) or a float multiplying hidden . weight.
    Returns:
        logprobs: fp32 [M, Kc], as `candidate_logits(...)[1]`.
    """
    if weight.requires_grad:
        raise ValueError("candidate_log_probs treats weight as frozen, but weight.requires_grad is True")
    if isinstance(inv_temperature, torch.Tensor):
        raise ValueError("candidate_log_probs takes a float inv_temperature (per-row tensors: use candidate_logits)")
    cand = cand if cand.stride(-1) == 1 else cand.contiguous()
    return _CandidateLogProbs.apply(hidden, weight, cand, bias, inv_temperature)
