"""Candidate logits ("top-K projection"): LM-head rows of the candidates only, then log-softmax.

Kernel 1, one program per (row m, block of BLOCK_K candidates): gather whole weight rows (coalesced
along Dm), multiply by the hidden row in fp32 and reduce once after the Dm loop. When a row fits in
one block it also does the log-softmax; otherwise a small per-row kernel does it from the logits.
Memory bound: it reads M*Kc*Dm + M*Dm input elements and writes 2*M*Kc floats.
"""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def hidden_weight_tile(hidden, p_w, valid, i_m, s_hm, d0, Dm, BLOCK_D: tl.constexpr):
    """Columns d0 .. d0 + BLOCK_D of the hidden row [BD] and of the candidates' weight rows [BK, BD] (zero past
    Dm and at invalid candidates), as stored."""
    o_d = d0 + tl.arange(0, BLOCK_D)
    m_d = o_d < Dm
    b_h = tl.load(hidden + i_m * s_hm + o_d, mask=m_d, other=0.0)
    b_w = tl.load(p_w + o_d[None, :], mask=valid[:, None] & m_d[None, :], other=0.0)
    return b_h, b_w


@triton.jit
def candidate_logits_fwd_kernel(
    hidden, weight, cand, bias, inv_t, rows, logits, logprobs, lse,
    s_hm, s_wv, s_cm, s_bm, Kc, Dm, V, inv_t_scalar,
    HAS_BIAS: tl.constexpr, INV_T_PER_ROW: tl.constexpr, FUSED: tl.constexpr, STORE_LSE: tl.constexpr,
    HAS_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr,
):
    """logits[m, k-block] of the candidates cand[m, k-block]; with FUSED (one block holds the row) also the
    log-softmax. PREFETCH: the next hidden block's loads are issued before this block's products (two tiles in
    registers), so a program keeps twice the bytes in flight (its loads are not staged through shared memory).

    hidden [M, Dm]; weight [V, Dm]; cand int [M, Kc]; bias fp32 [M, Kc] if HAS_BIAS; inv_t fp32 [M] if
    INV_T_PER_ROW (else the scalar inv_t_scalar); logits, logprobs fp32 [M, Kc]; lse fp32 [M] if STORE_LSE.
    HAS_ROWS: cand and bias are tables [R, Kc] and row m reads their row rows[m] (int64 [M]).
    """
    i_m, i_k = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_c = tl.load(rows + i_m) if HAS_ROWS else i_m                # the candidate row of query m
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_k = o_k < Kc
    ids = tl.load(cand + i_c * s_cm + o_k, mask=m_k, other=-1).to(tl.int64)
    valid = m_k & (ids >= 0) & (ids < V)
    p_w = weight + tl.where(valid, ids, 0)[:, None] * s_wv  # [BK, 1] row starts
    acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    if PREFETCH:
        n_h, n_w = hidden_weight_tile(hidden, p_w, valid, i_m, s_hm, 0, Dm, BLOCK_D)
        for d0 in range(0, Dm, BLOCK_D):
            b_h, b_w = n_h, n_w
            # the next block (all masked after the last)
            n_h, n_w = hidden_weight_tile(hidden, p_w, valid, i_m, s_hm, d0 + BLOCK_D, Dm, BLOCK_D)
            acc += b_w.to(tl.float32) * b_h.to(tl.float32)[None, :]
    else:
        for d0 in range(0, Dm, BLOCK_D):
            b_h, b_w = hidden_weight_tile(hidden, p_w, valid, i_m, s_hm, d0, Dm, BLOCK_D)  # [BD], [BK, BD]
            acc += b_w.to(tl.float32) * b_h.to(tl.float32)[None, :]
    b_l = tl.sum(acc, 1)
    if INV_T_PER_ROW:
        b_l = b_l * tl.load(inv_t + i_m).to(tl.float32)
    else:
        b_l = b_l * inv_t_scalar
    if HAS_BIAS:
        b_l += tl.load(bias + i_c * s_bm + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_l = tl.where(valid, b_l, float("-inf"))
    tl.store(logits + i_m * Kc + o_k, b_l, mask=m_k)
    if FUSED:
        mx = tl.max(b_l, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        se = tl.sum(tl.exp(b_l - mx), 0)
        b_lse = tl.where(se > 0, mx + tl.log(tl.where(se > 0, se, 1.0)), float("-inf"))
        # An all-pad row has lse = -inf: subtract 0 there (its entries are -inf anyway).
        lse_sub = tl.where(se > 0, b_lse, 0.0)
        tl.store(logprobs + i_m * Kc + o_k, tl.where(valid, b_l - lse_sub, float("-inf")), mask=m_k)
        if STORE_LSE:
            tl.store(lse + i_m, b_lse)


@triton.jit
def candidate_log_softmax_kernel(
    logits, cand, rows, logprobs, lse, s_cm, Kc, V, BLOCK_C: tl.constexpr, STORE_LSE: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    # One program per row; per-lane online max / sum, reduced across lanes at the end.
    i_m = tl.program_id(0).to(tl.int64)
    i_c = tl.load(rows + i_m) if HAS_ROWS else i_m
    m_v = tl.full([BLOCK_C], float("-inf"), dtype=tl.float32)
    s_v = tl.zeros([BLOCK_C], dtype=tl.float32)
    for c0 in range(0, Kc, BLOCK_C):
        o_c = c0 + tl.arange(0, BLOCK_C)
        b_l = tl.load(logits + i_m * Kc + o_c, mask=o_c < Kc, other=float("-inf"))
        m_new = tl.maximum(m_v, b_l)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_v = s_v * tl.exp(m_v - m_use) + tl.exp(b_l - m_use)
        m_v = m_new
    mx = tl.max(m_v, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    se = tl.sum(s_v * tl.exp(m_v - mx), 0)
    b_lse = tl.where(se > 0, mx + tl.log(tl.where(se > 0, se, 1.0)), float("-inf"))
    lse_sub = tl.where(se > 0, b_lse, 0.0)
    for c0 in range(0, Kc, BLOCK_C):
        o_c = c0 + tl.arange(0, BLOCK_C)
        m_c = o_c < Kc
        ids = tl.load(cand + i_c * s_cm + o_c, mask=m_c, other=-1)
        b_l = tl.load(logits + i_m * Kc + o_c, mask=m_c, other=float("-inf"))
        valid = (ids >= 0) & (ids < V)
        tl.store(logprobs + i_m * Kc + o_c, tl.where(valid, b_l - lse_sub, float("-inf")), mask=m_c)
    if STORE_LSE:
        tl.store(lse + i_m, b_lse)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True)
class CandidateTuning:
    """Launch parameters of `candidate_logits`; `CandidateTuning.for_shape(M, Kc, Dm, device)` is the default.

    block_k: candidates per program (grid (M, cdiv(Kc, block_k))); block_d: hidden columns per step of the
    Dm loop (both powers of 2); num_warps, num_stages: launch options; prefetch: each program issues the next
    hidden block's loads before this block's products (two tiles in registers, twice the bytes in flight).
    """
    block_k: int
    block_d: int
    num_warps: int
    num_stages: int
    prefetch: bool

    def __post_init__(self):
        for name in ("block_k", "block_d"):
            x = getattr(self, name)
            if x < 1 or x & (x - 1):
                raise ValueError(f"{name} must be a power of 2, got {x}")

    @classmethod
    def for_shape(cls, M: int, Kc: int, Dm: int, device: torch.device) -> "CandidateTuning":
        """The default for M query rows of Kc candidates over hidden size Dm.

        From 16 to 256 rows (verify shapes, memory bound): 4 candidates x 1024 columns with the next block's
        loads issued ahead. Below 16 rows (launch-latency bound): 4 x 2048 without. Above 256 rows (training
        shapes): the largest block_k of 32 / 16 / 8 that still gives ~4 programs per SM (else 4), tiles of 8K
        elements, without.
        """
        if 16 <= M <= 256:
            return cls(block_k=max(2, min(4, triton.next_power_of_2(Kc))),
                       block_d=min(1024, max(16, triton.next_power_of_2(Dm))),
                       num_warps=4, num_stages=3, prefetch=True)
        sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
        block_k = 4
        for bk in (32, 16, 8):
            if M > 256 and M * triton.cdiv(Kc, bk) >= 4 * sms:
                block_k = bk
                break
        block_k = max(2, min(block_k, triton.next_power_of_2(Kc)))
        return cls(block_k=block_k, block_d=min(8192 // block_k, max(16, triton.next_power_of_2(Dm))),
                   num_warps=4, num_stages=3, prefetch=False)


def candidate_logits_fwd(hidden, weight, cand, inv_temperature, bias, return_lse, tuning: CandidateTuning,
                         rows=None):
    M, Dm = hidden.shape
    Kc, V, dev = cand.shape[1], weight.shape[0], hidden.device
    logits = torch.empty(M, Kc, dtype=torch.float32, device=dev)
    logprobs = torch.empty(M, Kc, dtype=torch.float32, device=dev)
    lse = torch.empty(M, dtype=torch.float32, device=dev) if return_lse else None
    if M == 0:
        return (logits, logprobs, lse) if return_lse else (logits, logprobs)
    per_row = isinstance(inv_temperature, torch.Tensor)
    n_kb = triton.cdiv(Kc, tuning.block_k)
    candidate_logits_fwd_kernel[(M, n_kb)](
        hidden, weight, cand, bias, inv_temperature if per_row else None, rows, logits, logprobs, lse,
        hidden.stride(0), weight.stride(0), cand.stride(0), bias.stride(0) if bias is not None else 0,
        Kc, Dm, V, 1.0 if per_row or inv_temperature is None else float(inv_temperature),
        HAS_BIAS=bias is not None, INV_T_PER_ROW=per_row, FUSED=n_kb == 1, STORE_LSE=return_lse,
        HAS_ROWS=rows is not None, BLOCK_K=tuning.block_k, BLOCK_D=tuning.block_d, PREFETCH=tuning.prefetch,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )
    if n_kb > 1:
        candidate_log_softmax_kernel[(M,)](
            logits, cand, rows, logprobs, lse, cand.stride(0), Kc, V,
            BLOCK_C=min(1024, triton.next_power_of_2(Kc)), STORE_LSE=return_lse, HAS_ROWS=rows is not None,
            num_warps=4,
        )
    return (logits, logprobs, lse) if return_lse else (logits, logprobs)


def candidate_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    cand: torch.Tensor,
    inv_temperature: float | torch.Tensor | None = None,
    return_lse: bool = False,
    bias: torch.Tensor | None = None,
    tuning: CandidateTuning | None = None,
    rows: torch.Tensor | None = None,
):
    r"""LM-head logits of a few candidate tokens per row, and their log-softmax over those candidates.

    `logits[m, c] = (hidden[m] . weight[cand[m, c]]) * inv_temperature[m] + bias[m, c]` with fp32
    accumulation, then `logprobs = logits - logsumexp_{valid c}(logits)`. This is a log-softmax over
    the candidates only, not the full-vocabulary log-prob. Duplicate ids are separate entries: each
    copy gets the same logit and every copy counts in the normaliser (dedup before calling if that
    is not wanted). No host sync (CUDA-graph safe).

    Args:
        hidden: [M, Dm], one query vector per row (e.g. per tree node). fp16 / bf16 / fp32.
        weight: [Vocab, Dm], LM-head rows (row-major, last dim contiguous), any float dtype.
        cand: int32 / int64 [M, Kc], candidate ids; negative ids (-1) are padding, and so are ids
            >= Vocab (never read).
        inv_temperature: None (= 1), a float, or an fp32 tensor [M]. Multiplies h.w, not `bias`.
        return_lse: also return the per-row log-sum-exp.
        bias: fp32 [M, Kc] or None, added to the scaled logits before the log-softmax (Weaver:
            DFlash logits + the target-head residual).
        tuning: launch parameters. Default: `CandidateTuning.for_shape(M, Kc, Dm, hidden.device)`.
        rows: int64 [M] or None. Given, `cand` (and `bias`) are tables [R, Kc] and row m of the result uses
            their row rows[m] (0 <= rows[m] < R, not checked: no host read), without gathering them.
    Returns:
        logits: fp32 [M, Kc] (-inf at pads); logprobs: fp32 [M, Kc] (-inf at pads; an all-pad row
        is all -inf); lse: fp32 [M] (-inf for an all-pad row), only if `return_lse`.

    Example::

        >>> lg, lp = candidate_logits(h, lm_head.weight, topk_ids, bias=dflash_logits)
    """
    if hidden.dim() != 2 or weight.dim() != 2 or cand.dim() != 2:
        raise ValueError(f"hidden, weight, cand must be 2-D, got {hidden.dim()}, {weight.dim()}, {cand.dim()}")
    M, Dm = hidden.shape
    if weight.shape[1] != Dm or (cand.shape[0] != M and rows is None):
        raise ValueError(f"expected weight [Vocab, {Dm}] and cand [{M}, Kc], got "
                         f"{tuple(weight.shape)} and {tuple(cand.shape)}")
    if rows is not None and (tuple(rows.shape) != (M,) or rows.dtype != torch.int64 or rows.device != hidden.device):
        raise ValueError(f"rows must be int64 [{M}] on {hidden.device}, got {rows.dtype} {tuple(rows.shape)}")
    if cand.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cand must be int32 or int64, got {cand.dtype}")
    if cand.shape[1] == 0:
        raise ValueError("cand must have at least one column (Kc >= 1)")
    if bias is not None and tuple(bias.shape) != tuple(cand.shape):
        raise ValueError(f"bias must be [M, Kc] = {tuple(cand.shape)}, got {tuple(bias.shape)}")
    if isinstance(inv_temperature, torch.Tensor):
        if tuple(inv_temperature.shape) != (M,):
            raise ValueError(f"a tensor inv_temperature must be [M] = [{M}], got {tuple(inv_temperature.shape)}")
        inv_temperature = inv_temperature.to(torch.float32).contiguous()
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    cand = cand if cand.stride(-1) == 1 else cand.contiguous()
    if bias is not None:
        bias = bias.to(torch.float32)
        bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    tuning = CandidateTuning.for_shape(M, cand.shape[1], Dm, hidden.device) if tuning is None else tuning
    if not isinstance(tuning, CandidateTuning):
        raise TypeError(f"tuning must be a CandidateTuning, got {type(tuning).__name__}")
    rows = rows if rows is None or rows.is_contiguous() else rows.contiguous()
    return candidate_logits_fwd(hidden, weight, cand, inv_temperature, bias, return_lse, tuning, rows)
