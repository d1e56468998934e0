"""A linear layer over a few rows with its neighbours fused in (Triton, forward only):

    y = residual + act(rms_norm(x) @ W.T + b)        x [M, K] (or table rows x = T[index]), W [N_w, K]

one launch where torch takes three to five (the norm, the GEMM, the activation, the residual add). Made for layers
whose time is mostly launches: few rows and small weights (`small_linear_fits`), as in the Weaver's tree-build
steps and the forwards of small targets and drafters over a tree or a draft block. Each program computes a
[BM, BN] tile of y over the whole K: with `norm` it first sums the squares of its rows (x is a few KB, read again
from L2), then normalises each [BM, BK] chunk of x as it is loaded; with `swiglu` it accumulates the gate and the
up tile of its columns (W rows n and N + n) and multiplies them in the epilogue. A row's result does not depend on
M or on the other rows (the same tiles, the same order of the sum), so a batch of steps and a single step agree bit
for bit.

Roundings are those of the torch modules it replaces (`tfm_runtime.models.common.RMSNorm`: the normalised x rounded
to x's dtype, times the weight rounded, plus the bias rounded; the GEMM accumulated in fp32 and rounded once with its
bias; `tfm_kernels.swiglu`: silu(gate) * up in fp32 from the rounded gate and up, rounded once; the residual added
in fp32 and rounded), so they differ from torch only in the order of the fp32 sums.
"""
import torch
import triton
import triton.language as tl

from tfm_kernels.launch import strided_rows

SMALL_M = 80            # the row counts this kernel is for (five 16-row blocks: a 65-node tree, the Weaver's
                        # steps): each row block reads the whole weight
SMALL_WEIGHT = 1 << 24  # the weights it is for (elements; 32 MB in bf16, streamed in ~10 us): launches, not
                        # bytes, dominate such a layer, and past it cuBLAS's GEMV / GEMM streams faster


def small_linear_fits(rows: int, *weights: torch.Tensor) -> bool:
    """Whether a layer is one `small_linear` is for: at most SMALL_M rows, each weight at most SMALL_WEIGHT
    elements."""
    return rows <= SMALL_M and all(w.numel() <= SMALL_WEIGHT for w in weights)


@triton.jit
def _accumulate(x, row, m_m, nw, nb, w, n1, n2, m_n, K, s_w, eps, NORM: tl.constexpr, NORM_BIAS: tl.constexpr,
                TWO: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc1 = rms_norm(x) @ w[n1].T (and with TWO acc2 = ... @ w[n2].T), fp32 [BM, BN]: rows of x at offsets
    row [BM] (in range where m_m), weight rows n1, n2 [BN] (in range where m_n), over the whole K in BK chunks."""
    dt = w.dtype.element_ty
    o_k = tl.arange(0, BK)
    if NORM:                                            # mean of squares of the whole row, fp32
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            mk = (k0 + o_k) < K
            xa = tl.load(x + row[:, None] + (k0 + o_k)[None, :], mask=m_m[:, None] & mk[None, :], other=0.)
            xa = xa.to(tl.float32)
            ss += tl.sum(xa * xa, axis=1)
        rstd = tl.rsqrt(ss / K + eps)                                                       # [BM]
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    p_w1, p_w2 = w + n1[None, :].to(tl.int64) * s_w, w + n2[None, :].to(tl.int64) * s_w     # [1, BN]
    for k0 in range(0, K, BK):
        mk = (k0 + o_k) < K
        xa = tl.load(x + row[:, None] + (k0 + o_k)[None, :], mask=m_m[:, None] & mk[None, :], other=0.)  # [BM, BK]
        if NORM:
            xn = (xa.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)
            xn = (xn * tl.load(nw + k0 + o_k, mask=mk, other=0.).to(tl.float32)[None, :]).to(dt)
            if NORM_BIAS:
                xn = (xn.to(tl.float32) + tl.load(nb + k0 + o_k, mask=mk, other=0.).to(tl.float32)[None, :]).to(dt)
            xa = xn
        m_w = mk[:, None] & m_n[None, :]
        w1 = tl.load(p_w1 + (k0 + o_k)[:, None], mask=m_w, other=0.)                       # [BK, BN]
        if IEEE:
            acc1 = tl.dot(xa, w1, acc1, input_precision="ieee")
        else:
            acc1 = tl.dot(xa, w1, acc1)
        if TWO:
            w2 = tl.load(p_w2 + (k0 + o_k)[:, None], mask=m_w, other=0.)                   # [BK, BN]
            if IEEE:
                acc2 = tl.dot(xa, w2, acc2, input_precision="ieee")
            else:
                acc2 = tl.dot(xa, w2, acc2)
    return acc1, acc2


@triton.jit
def small_linear_kernel(x, idx, nw, nb, w, b, r, y, M, N, K, s_x, s_w, s_r, eps, HAS_IDX: tl.constexpr,
                        NORM: tl.constexpr, NORM_BIAS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                        SWIGLU: tl.constexpr, SILU_ROUNDED: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr):
    """Tile (program_id(0), program_id(1)) of y [M, N] (row-major). Row m of x at m * s_x (HAS_IDX: idx[m] * s_x),
    row n of w at n * s_w (SWIGLU: the up rows at (N + n) * s_w), row m of r at m * s_r; last dims contiguous.
    nw, nb [K]: the norm's weight and bias; b [N] ([2N] with SWIGLU). SILU_ROUNDED: silu(gate) rounded to y's dtype
    before the product. IEEE: fp32 products in full precision."""
    dt = y.dtype.element_ty
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    if HAS_IDX:
        row = tl.load(idx + o_m, mask=m_m, other=0).to(tl.int64) * s_x                    # [BM]
    else:
        row = o_m.to(tl.int64) * s_x
    acc, acc_up = _accumulate(x, row, m_m, nw, nb, w, o_n, o_n + N, m_n, K, s_w, eps, NORM, NORM_BIAS, SWIGLU,
                              IEEE, BM, BN, BK)
    if HAS_BIAS:
        acc += tl.load(b + o_n, mask=m_n, other=0.).to(tl.float32)[None, :]
    out = acc.to(dt)
    if SWIGLU:
        if HAS_BIAS:
            acc_up += tl.load(b + N + o_n, mask=m_n, other=0.).to(tl.float32)[None, :]
        g, u = out.to(tl.float32), acc_up.to(dt).to(tl.float32)
        if SILU_ROUNDED:
            out = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)
        else:
            out = (g * tl.sigmoid(g) * u).to(dt)
    m_y = m_m[:, None] & m_n[None, :]
    if HAS_RES:
        res = tl.load(r + o_m[:, None].to(tl.int64) * s_r + o_n[None, :], mask=m_y, other=0.).to(tl.float32)
        out = (res + out.to(tl.float32)).to(dt)
    tl.store(y + o_m[:, None].to(tl.int64) * N + o_n[None, :], out, mask=m_y)


@triton.jit
def small_qkv_rope_kernel(x, nw, nb, w, cos, sin, pos, q, k, v, M, T, K, s_x, s_w, eps, q_sb, q_sh, q_st, k_sb,
                          k_sh, k_st, v_sb, v_sh, v_st, NH, HALF, POS: tl.constexpr, NORM: tl.constexpr,
                          NORM_BIAS: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr):
    """Program (row block, (part * NH + head) * NC + chunk), NC = cdiv(HALF, BN): columns chunk * BN .. of both
    halves of one head of q, k or v (part 0 / 1 / 2; weight rows (part * NH + head) * 2 * HALF + d and + HALF + d).
    q and k are rotated by cos, sin [P, 2 * HALF] at row pos[m] (POS) or at row m % T, then every part is stored
    to its tensor at (m // T) * s_b + head * s_h + (m % T) * s_t + d (last dims contiguous)."""
    dt = w.dtype.element_ty
    NC = tl.cdiv(HALF, BN)
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    ph, c = tl.program_id(1) // NC, tl.program_id(1) % NC
    part, head = ph // NH, ph % NH
    o_d = c * BN + tl.arange(0, BN)
    m_m, m_d = o_m < M, o_d < HALF
    n1 = ph * 2 * HALF + o_d
    a1, a2 = _accumulate(x, o_m.to(tl.int64) * s_x, m_m, nw, nb, w, n1, n1 + HALF, m_d, K, s_w, eps, NORM, NORM_BIAS,
                         True, IEEE, BM, BN, BK)
    x1, x2 = a1.to(dt).to(tl.float32), a2.to(dt).to(tl.float32)                             # the projection's
    if POS:
        p_c = tl.load(pos + o_m, mask=m_m, other=0).to(tl.int64) * (2 * HALF)
    else:
        p_c = (o_m % T).to(tl.int64) * (2 * HALF)
    m_y = m_m[:, None] & m_d[None, :]
    p_t = p_c[:, None] + o_d[None, :]
    c1 = tl.load(cos + p_t, mask=m_y, other=0.).to(tl.float32)
    c2 = tl.load(cos + p_t + HALF, mask=m_y, other=0.).to(tl.float32)
    s1 = tl.load(sin + p_t, mask=m_y, other=0.).to(tl.float32)
    s2 = tl.load(sin + p_t + HALF, mask=m_y, other=0.).to(tl.float32)
    y1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)   # as `apply_rope` rounds
    y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    bb, tt = (o_m // T).to(tl.int64), (o_m % T).to(tl.int64)
    if part == 0:
        dst = q + (bb * q_sb + head * q_sh + tt * q_st)[:, None] + o_d[None, :]
        tl.store(dst, y1, mask=m_y)
        tl.store(dst + HALF, y2, mask=m_y)
    elif part == 1:
        dst = k + (bb * k_sb + head * k_sh + tt * k_st)[:, None] + o_d[None, :]
        tl.store(dst, y1, mask=m_y)
        tl.store(dst + HALF, y2, mask=m_y)
    else:
        dst = v + (bb * v_sb + head * v_sh + tt * v_st)[:, None] + o_d[None, :]
        tl.store(dst, x1.to(dt), mask=m_y)
        tl.store(dst + HALF, x2.to(dt), mask=m_y)


def _check(name: str, x: torch.Tensor, tensors, norm_weight, norm_bias, index) -> None:
    """What both wrappers ask of their inputs: x and `tensors` (None skipped) of one float dtype (fp16 / bf16 / fp32)
    and device, each with a contiguous last dim; the index (or positions) on that device; no norm bias without a
    norm weight."""
    ts = [t for t in tensors if t is not None]
    if norm_bias is not None and norm_weight is None:
        raise ValueError(f"{name}: norm_bias needs norm_weight")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or any(t.dtype != x.dtype for t in ts):
        raise ValueError(f"{name} expects fp16, bf16 or fp32 tensors of one dtype, got x {x.dtype} and "
                         f"{sorted({str(t.dtype) for t in ts})}")
    if any(t.device != x.device for t in ts) or (index is not None and index.device != x.device):
        raise ValueError(f"{name} expects every tensor on one device")
    if x.stride(-1) != 1 or any(t.stride(-1) != 1 for t in ts):
        raise ValueError(f"{name} expects tensors with a contiguous last dim")


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 index: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                 norm_bias: torch.Tensor | None = None, eps: float = 1e-6, swiglu: bool = False,
                 silu_rounded: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + act(rms_norm(x) @ weight.T + bias) in one launch (forward only; module docstring).

    Args:
        x: [..., K] fp16 / bf16 / fp32 on a Triton device, last dim contiguous; with `index`, a table [V, K] whose
            rows index [...] (long, in range: not checked, no host read) are the input (an embedding lookup).
        weight: [N_w, K] ([out, in] as nn.Linear), last dim contiguous; bias [N_w] or None.
        norm_weight, norm_bias: [K] or None: x goes through RMSNorm (eps) first when norm_weight is given.
        swiglu: y = silu(y[..., :N]) * y[..., N:], N = N_w / 2 (weight rows: gate, then up); else N = N_w. Rounded
            once, as `tfm_kernels.swiglu` (the Weaver's); `silu_rounded`: silu rounded first, as `F.silu(gate) * up`
            and `tfm_kernels.swiglu.silu_mul` (the targets' and DFlash's MLPs).
        residual: [..., N] or None (last dim contiguous): added last.
    Returns:
        y: [..., N] of x's dtype, contiguous.
    """
    lead = tuple(index.shape) if index is not None else tuple(x.shape[:-1])
    K, N_w = x.shape[-1], weight.shape[0]
    N = N_w // 2 if swiglu else N_w
    if weight.dim() != 2 or weight.shape[1] != K or (swiglu and N_w % 2) or K == 0 or N == 0:
        raise ValueError(f"small_linear expects x [..., K] and weight [N_w, K] (N_w even with swiglu), K, N > 0, "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if index is not None and (x.dim() != 2 or index.dtype != torch.long):
        raise ValueError(f"small_linear with index expects a table [V, K] and a long index, got {tuple(x.shape)} "
                         f"and {index.dtype}")
    for name, t, shape in (("bias", bias, (N_w,)), ("norm_weight", norm_weight, (K,)), ("norm_bias", norm_bias, (K,)),
                           ("residual", residual, (*lead, N))):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"small_linear expects {name} {list(shape)}, got {list(t.shape)}")
    _check("small_linear", x, (weight, bias, norm_weight, norm_bias, residual), norm_weight, norm_bias, index)
    if index is not None:
        x2, idx = x, index.reshape(-1).contiguous()
    else:
        x2, idx = strided_rows(x), None
    M = idx.shape[0] if idx is not None else x2.shape[0]
    r2 = strided_rows(residual) if residual is not None else None
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        BM, BN, BK = 16, 16 if N <= 1024 else 32, max(16, min(128, triton.next_power_of_2(K)))
        dummy = weight                                              # any pointer for the arguments not read
        small_linear_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
            x2, idx if idx is not None else dummy, norm_weight if norm_weight is not None else dummy,
            norm_bias if norm_bias is not None else dummy, weight, bias if bias is not None else dummy,
            r2 if r2 is not None else dummy, y, M, N, K, x2.stride(0), weight.stride(0),
            r2.stride(0) if r2 is not None else 0, eps, HAS_IDX=idx is not None, NORM=norm_weight is not None,
            NORM_BIAS=norm_bias is not None, HAS_BIAS=bias is not None, HAS_RES=r2 is not None, SWIGLU=swiglu,
            SILU_ROUNDED=silu_rounded, IEEE=x.dtype == torch.float32, BM=BM, BN=BN, BK=BK, num_warps=4, num_stages=3)
    return y.view(*lead, N)


def small_qkv_rope(x: torch.Tensor, weight: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None,
                   norm_bias: torch.Tensor | None = None, eps: float = 1e-6, k_out: torch.Tensor | None = None,
                   v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of an attention layer from its fused projection, rotated, in one launch (forward only): the
    projection of `small_linear` (with its norm prologue) and the rotary embedding of `tfm_kernels.rope.rope_qk`
    (the same roundings), k and v written where the caller wants them.

    Args:
        x: [B, T, K] fp16 / bf16 / fp32 on a Triton device, last dim contiguous.
        weight: [3 * nh * hd, K], rows q heads, k heads, v heads (each head's hd rows together); hd even.
        cos, sin: tables [P, hd] of x's dtype read at positions [B, T] (long, in range: not checked), or without
            positions [T, hd] (token t at row t).
        norm_weight, norm_bias, eps: RMSNorm of x first, as `small_linear`.
        k_out, v_out: [B, nh, T, hd] of x's dtype with a contiguous last dim (e.g. the next slots of a static K/V
            state), or None (new tensors).
    Returns:
        q [B, nh, T, hd] contiguous, k (k_out or new), v (v_out or new).
    """
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[1] != x.shape[-1] or num_heads < 1 \
            or weight.shape[0] % (6 * num_heads) or 0 in x.shape:
        raise ValueError(f"small_qkv_rope expects x [B, T, K] and weight [3 * nh * hd, K] with hd even, nh = "
                         f"{num_heads}, got {tuple(x.shape)} and {tuple(weight.shape)}")
    B, T, K = x.shape
    NH, hd = num_heads, weight.shape[0] // (3 * num_heads)
    rows = cos.shape[0] if positions is not None else T
    for name, t, shape in (("cos", cos, (rows, hd)), ("sin", sin, (rows, hd)), ("positions", positions, (B, T)),
                           ("norm_weight", norm_weight, (K,)), ("norm_bias", norm_bias, (K,)),
                           ("k_out", k_out, (B, NH, T, hd)), ("v_out", v_out, (B, NH, T, hd))):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"small_qkv_rope expects {name} {list(shape)}, got {list(t.shape)}")
    if positions is not None and positions.dtype != torch.long:
        raise ValueError(f"small_qkv_rope expects long positions, got {positions.dtype}")
    _check("small_qkv_rope", x, (weight, norm_weight, norm_bias, k_out, v_out, cos, sin), norm_weight, norm_bias,
           positions)
    cos, sin = cos.contiguous(), sin.contiguous()
    x2 = strided_rows(x)
    q = torch.empty(B, NH, T, hd, dtype=x.dtype, device=x.device)
    k = torch.empty_like(q) if k_out is None else k_out
    v = torch.empty_like(q) if v_out is None else v_out
    HALF = hd // 2
    BM, BN, BK = 16, max(16, min(32, triton.next_power_of_2(HALF))), max(16, min(128, triton.next_power_of_2(K)))
    small_qkv_rope_kernel[(triton.cdiv(B * T, BM), 3 * NH * triton.cdiv(HALF, BN))](
        x2, norm_weight if norm_weight is not None else weight, norm_bias if norm_bias is not None else weight,
        weight, cos, sin, positions if positions is not None else cos, q, k, v, B * T, T, K, x2.stride(0),
        weight.stride(0), eps, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], NH, HALF,
        POS=positions is not None, NORM=norm_weight is not None, NORM_BIAS=norm_bias is not None,
        IEEE=x.dtype == torch.float32, BM=BM, BN=BN, BK=BK, num_warps=4, num_stages=3)
    return q, k, v

