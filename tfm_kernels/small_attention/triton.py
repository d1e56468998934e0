"""Small masked attention (T, S <= 128 keys) in one Triton program per (batch, head), forward and backward.

The whole [T, S] score tile fits one program, so there is no online softmax: the forward reads q, k, v
once, writes o and the row log-sum-exp; the backward reads q, k, v, lse and do once, recomputes the
probabilities from lse and writes dq, dk, dv. The ops are registered with torch.library
(`tfm::small_attention_fwd`, `tfm::small_attention_bwd`) with fake implementations and an autograd
formula, so torch.compile traces through them without a graph break.
"""
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Inside @triton.jit only constexpr globals may be read (the interpreter does not enforce it; the compiler does).
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(0.6931471805599453)
MAX_T, MAX_D = 128, 256


@triton.jit
def _scores_log2(q, k, v, mask, i_b, i_h, qk_scale,
                 s_qb, s_qh, s_qt, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_mt, s_ms, T, S,
                 D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, DOT_PREC: tl.constexpr):
    """Loads the q [BT, BD], k [BS, BD], v [BS, BD] tiles of (i_b, i_h) (zero padded) and returns them with the
    scores s [BT, BS] fp32 in the log2 domain (qk_scale = scale * log2 e) and visible [BT, BS] (mask & in range)."""
    o_t, o_s, o_d = tl.arange(0, BT), tl.arange(0, BS), tl.arange(0, BD)
    m_t, m_s, m_d = o_t < T, o_s < S, o_d < D
    i_b64 = i_b.to(tl.int64)
    b_q = tl.load(q + i_b64 * s_qb + i_h * s_qh + o_t[:, None] * s_qt + o_d[None, :],
                  mask=m_t[:, None] & m_d[None, :], other=0.0)
    b_k = tl.load(k + i_b64 * s_kb + i_h * s_kh + o_s[:, None] * s_ks + o_d[None, :],
                  mask=m_s[:, None] & m_d[None, :], other=0.0)
    b_v = tl.load(v + i_b64 * s_vb + i_h * s_vh + o_s[:, None] * s_vs + o_d[None, :],
                  mask=m_s[:, None] & m_d[None, :], other=0.0)
    m_ts = m_t[:, None] & m_s[None, :]
    visible = (tl.load(mask + o_t[:, None] * s_mt + o_s[None, :] * s_ms, mask=m_ts, other=0) != 0) & m_ts
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * qk_scale
    return b_q, b_k, b_v, tl.where(visible, b_s, float("-inf")), visible


@triton.jit
def small_attention_fwd_kernel(
    q, k, v, mask, o, lse, qk_scale,
    s_qb, s_qh, s_qt, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_mt, s_ms, NH, T, S,
    D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program per (b, h) of grid B * NH.

    q [B, NH, T, D], k, v [B, NH, S, D] (strides s_*b, s_*h, s_*t/s; last dim contiguous); mask int8 [T, S]
    (strides s_mt, s_ms; nonzero = visible), shared by all programs. Writes o [B, T, NH, D] contiguous (q's
    dtype) and lse fp32 [B, NH, T] contiguous (natural log). A row with no visible key: o = 0, lse = -inf.
    """
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // NH, i_bh % NH
    _, _, b_v, b_s, _ = _scores_log2(q, k, v, mask, i_b, i_h, qk_scale, s_qb, s_qh, s_qt, s_kb, s_kh, s_ks,
                                     s_vb, s_vh, s_vs, s_mt, s_ms, T, S, D, BT, BS, BD, DOT_PREC)
    b_m = tl.max(b_s, 1)                                                        # [BT]
    b_m = tl.where(b_m == float("-inf"), 0.0, b_m)                              # empty rows: exp2(-inf - 0) = 0
    b_p = tl.exp2(b_s - b_m[:, None])                                           # [BT, BS], 0 where masked
    b_l = tl.sum(b_p, 1)
    b_l1 = tl.where(b_l > 0, b_l, 1.0)
    b_p = b_p / b_l1[:, None]
    b_o = tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)              # [BT, BD] fp32

    o_t, o_d = tl.arange(0, BT), tl.arange(0, BD)
    m_t = o_t < T
    row = (i_b.to(tl.int64) * T + o_t) * NH + i_h                              # [BT] rows of o [B*T*NH, D]
    tl.store(o + row[:, None] * D + o_d[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None] & (o_d < D)[None, :])
    b_lse = tl.where(b_l > 0, (b_m + tl.log2(b_l1)) * LN2_C, float("-inf"))
    tl.store(lse + i_bh.to(tl.int64) * T + o_t, b_lse, mask=m_t)


@triton.jit
def small_attention_bwd_kernel(
    do, q, k, v, mask, lse, dq, dk, dv, sm_scale, qk_scale,
    s_ob, s_ot, s_oh, s_qb, s_qh, s_qt, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_mt, s_ms, NH, T, S,
    D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program per (b, h) of grid B * NH.

    do [B, T, NH, D] (strides s_ob, s_ot, s_oh); q, k, v, mask as in the forward; lse fp32 [B, NH, T] from the
    forward. Writes dq [B, T, NH, D], dk, dv [B, S, NH, D], contiguous, in q's dtype:
        p = exp(scale * q k^T - lse) (0 where masked), dv = p^T do, dp = do v^T, delta = rowsum(p * dp),
        ds = p * (dp - delta), dq = scale * ds k, dk = scale * ds^T q.
    """
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // NH, i_bh % NH
    b_q, b_k, b_v, b_s, visible = _scores_log2(q, k, v, mask, i_b, i_h, qk_scale, s_qb, s_qh, s_qt, s_kb, s_kh,
                                               s_ks, s_vb, s_vh, s_vs, s_mt, s_ms, T, S, D, BT, BS, BD, DOT_PREC)
    o_t, o_s, o_d = tl.arange(0, BT), tl.arange(0, BS), tl.arange(0, BD)
    m_t, m_s, m_d = o_t < T, o_s < S, o_d < D
    b_lse = tl.load(lse + i_bh.to(tl.int64) * T + o_t, mask=m_t, other=0.0) * LOG2E_C
    b_lse = tl.where(b_lse == float("-inf"), 0.0, b_lse)                         # empty rows: p = 0 below
    b_p = tl.where(visible, tl.exp2(b_s - b_lse[:, None]), 0.0)                 # [BT, BS] fp32
    b_do = tl.load(do + i_b.to(tl.int64) * s_ob + o_t[:, None] * s_ot + i_h * s_oh + o_d[None, :],
                   mask=m_t[:, None] & m_d[None, :], other=0.0)                 # [BT, BD]

    row_t = (i_b.to(tl.int64) * T + o_t) * NH + i_h                              # rows of dq [B*T*NH, D]
    row_s = (i_b.to(tl.int64) * S + o_s) * NH + i_h                              # rows of dk, dv [B*S*NH, D]
    m_td, m_sd = m_t[:, None] & m_d[None, :], m_s[:, None] & m_d[None, :]
    # Each gradient is stored as soon as it is computed, so that its fp32 tile need not stay live.
    b_dv = tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=DOT_PREC)  # [BS, BD]
    tl.store(dv + row_s[:, None] * D + o_d[None, :], b_dv.to(dv.dtype.element_ty), mask=m_sd)
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)                 # [BT, BS]
    b_delta = tl.sum(b_p * b_dp, 1)                                              # [BT] = rowsum(do * o)
    b_ds = (b_p * (b_dp - b_delta[:, None])).to(b_q.dtype)                       # [BT, BS]
    b_dq = tl.dot(b_ds, b_k, input_precision=DOT_PREC) * sm_scale                # [BT, BD]
    tl.store(dq + row_t[:, None] * D + o_d[None, :], b_dq.to(dq.dtype.element_ty), mask=m_td)
    b_dk = tl.dot(tl.trans(b_ds), b_q, input_precision=DOT_PREC) * sm_scale      # [BS, BD]
    tl.store(dk + row_s[:, None] * D + o_d[None, :], b_dk.to(dk.dtype.element_ty), mask=m_sd)


def _config(q, T, S, hd):
    """Tile sizes (powers of two >= 16, as tl.dot needs) and launch options of one (b, h) program, for the
    forward and the backward: 4 warps, 8 for tiles over 64 x 128."""
    BT, BS, BD = (max(16, triton.next_power_of_2(n)) for n in (T, S, hd))
    big = BT * BD > 64 * 128 or BS * BD > 64 * 128
    return dict(BT=BT, BS=BS, BD=BD, D=hd, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
                num_warps=8 if big else 4)


def _unit_last(x):
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("tfm::small_attention_fwd", mutates_args=())
def small_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, nh, T, hd], k, v [B, nh, S, hd], mask bool [T, S] -> o [B, T, nh, hd] (q's dtype), lse fp32 [B, nh, T]."""
    B, nh, T, hd = q.shape
    S = k.shape[2]
    o = torch.empty(B, T, nh, hd, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, nh, T, dtype=torch.float32, device=q.device)
    if B * nh == 0:
        return o, lse
    q, k, v, m8 = _unit_last(q), _unit_last(k), _unit_last(v), mask.view(torch.int8)
    small_attention_fwd_kernel[(B * nh,)](
        q, k, v, m8, o, lse, scale * LOG2E,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *m8.stride(), nh, T, S, **_config(q, T, S, hd))
    return o, lse


@small_attention_fwd.register_fake
def _(q, k, v, mask, scale):
    B, nh, T, hd = q.shape
    return q.new_empty(B, T, nh, hd), q.new_empty(B, nh, T, dtype=torch.float32)


@torch.library.custom_op("tfm::small_attention_bwd", mutates_args=())
def small_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """do [B, T, nh, hd], q/k/v/mask as the forward's, lse fp32 [B, nh, T] ->
    dq [B, T, nh, hd], dk, dv [B, S, nh, hd] (contiguous, q's dtype)."""
    B, nh, T, hd = q.shape
    S = k.shape[2]
    dq = torch.empty(B, T, nh, hd, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, S, nh, hd, dtype=q.dtype, device=q.device)
    dv = torch.empty(B, S, nh, hd, dtype=q.dtype, device=q.device)
    if B * nh == 0:
        return dq, dk, dv
    assert do.shape == (B, T, nh, hd) and lse.shape == (B, nh, T) and lse.is_contiguous()
    do, q, k, v, m8 = _unit_last(do.to(q.dtype)), _unit_last(q), _unit_last(k), _unit_last(v), mask.view(torch.int8)
    small_attention_bwd_kernel[(B * nh,)](
        do, q, k, v, m8, lse, dq, dk, dv, scale, scale * LOG2E,
        *do.stride()[:3], *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *m8.stride(), nh, T, S,
        **_config(q, T, S, hd))
    return dq, dk, dv


@small_attention_bwd.register_fake
def _(do, q, k, v, mask, lse, scale):
    B, nh, T, hd = q.shape
    S = k.shape[2]
    return q.new_empty(B, T, nh, hd), q.new_empty(B, S, nh, hd), q.new_empty(B, S, nh, hd)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, scale = inputs
    _, lse = output
    ctx.save_for_backward(q, k, v, mask, lse)
    ctx.scale = scale


def _backward(ctx, do, dlse):
    # dlse is ignored: lse is an auxiliary output for the backward, never differentiated.
    q, k, v, mask, lse = ctx.saved_tensors
    dq, dk, dv = small_attention_bwd(do, q, k, v, mask, lse, ctx.scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None


torch.library.register_autograd("tfm::small_attention_fwd", _backward, setup_context=_setup_context)


def small_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    r"""Differentiable `softmax(scale * q k^T, masked) v` for few keys, one Triton program per (batch, head).

    fp32 scores and softmax; the dots take q's dtype (fp32 dots in "ieee" precision). A row with no visible
    key gives o = 0 and zero gradients (no NaN).

    Args:
        q: [B, nh, T, hd]; k, v: [B, nh, S, hd]; fp16 / bf16 / fp32, one dtype, one device, any strides
            (a last dim with stride != 1 is copied). T, S <= 128, hd <= 256.
        mask: bool [T, S] or [1, 1, T, S], True = visible, shared by all batch rows and heads.
        scale: Default: hd ** -0.5.
    Returns:
        o: [B, nh, T, hd] in q's dtype, a view of a contiguous [B, T, nh, hd] tensor (so that
        `o.transpose(1, 2).reshape(B, T, nh * hd)` is free).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, nh, T|S, hd], got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    B, nh, T, hd = q.shape
    S = k.shape[2]
    if k.shape != (B, nh, S, hd) or v.shape != k.shape:
        raise ValueError(f"k, v must be [B, nh, S, hd] with B={B}, nh={nh}, hd={hd} (from q), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if not (1 <= T <= MAX_T and 1 <= S <= MAX_T and 1 <= hd <= MAX_D):
        raise ValueError(f"small_attention takes 1 <= T, S <= {MAX_T} and 1 <= hd <= {MAX_D}, "
                         f"got T={T}, S={S}, hd={hd}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one dtype of float16, bfloat16, float32, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if mask.dtype != torch.bool or tuple(mask.shape) not in ((T, S), (1, 1, T, S)):
        raise ValueError(f"mask must be bool [T, S] or [1, 1, T, S] = [{T}, {S}], got {mask.dtype} {tuple(mask.shape)}")
    if not (q.device == k.device == v.device == mask.device):
        raise ValueError(f"q, k, v, mask must be on one device, got {q.device}, {k.device}, {v.device}, {mask.device}")
    scale = hd ** -0.5 if scale is None else float(scale)
    o, _ = small_attention_fwd(q, k, v, mask.reshape(T, S), scale)               # o [B, T, nh, hd]
    return o.transpose(1, 2)
