"""A linear layer over a few rows with its neighbours fused in (Triton, forward only):

    y = residual + act(rms_norm(x) @ W.T + b)        x [M, K] (or table rows x = T[index]), W [N_w, K]

one launch where torch takes three to five (the norm, the GEMM, the activation, the residual add). Made for the
Weaver's tree-build steps, whose matrices have 1-16 rows and whose time is mostly launches. Each program computes a
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

SMALL_M = 64    # the row counts this kernel is for: each of the cdiv(M, 16) row blocks reads the whole weight


@triton.jit
def small_linear_kernel(x, idx, nw, nb, w, b, r, y, M, N, K, s_x, s_w, s_r, eps, HAS_IDX: tl.constexpr,
                        NORM: tl.constexpr, NORM_BIAS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                        SWIGLU: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr):
    """Tile (program_id(0), program_id(1)) of y [M, N] (row-major). Row m of x at m * s_x (HAS_IDX: idx[m] * s_x),
    row n of w at n * s_w (SWIGLU: the up rows at (N + n) * s_w), row m of r at m * s_r; last dims contiguous.
    nw, nb [K]: the norm's weight and bias; b [N] ([2N] with SWIGLU). IEEE: fp32 products in full precision."""
    dt = y.dtype.element_ty
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m, m_n = o_m < M, o_n < N
    if HAS_IDX:
        row = tl.load(idx + o_m, mask=m_m, other=0).to(tl.int64) * s_x                    # [BM]
    else:
        row = o_m.to(tl.int64) * s_x
    if NORM:                                            # mean of squares of the whole row, fp32
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            mk = (k0 + o_k) < K
            xa = tl.load(x + row[:, None] + (k0 + o_k)[None, :], mask=m_m[:, None] & mk[None, :], other=0.)
            xa = xa.to(tl.float32)
            ss += tl.sum(xa * xa, axis=1)
        rstd = tl.rsqrt(ss / K + eps)                                                       # [BM]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    p_w = w + o_n[None, :].to(tl.int64) * s_w                                               # [1, BN]
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
        wt = tl.load(p_w + (k0 + o_k)[:, None], mask=m_w, other=0.)                        # [BK, BN]
        if IEEE:
            acc = tl.dot(xa, wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(xa, wt, acc)
        if SWIGLU:
            wu = tl.load(p_w + N * s_w + (k0 + o_k)[:, None], mask=m_w, other=0.)          # [BK, BN]
            if IEEE:
                acc_up = tl.dot(xa, wu, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(xa, wu, acc_up)
    if HAS_BIAS:
        acc += tl.load(b + o_n, mask=m_n, other=0.).to(tl.float32)[None, :]
    out = acc.to(dt)
    if SWIGLU:
        if HAS_BIAS:
            acc_up += tl.load(b + N + o_n, mask=m_n, other=0.).to(tl.float32)[None, :]
        g, u = out.to(tl.float32), acc_up.to(dt).to(tl.float32)
        out = (g * tl.sigmoid(g) * u).to(dt)
    m_y = m_m[:, None] & m_n[None, :]
    if HAS_RES:
        res = tl.load(r + o_m[:, None].to(tl.int64) * s_r + o_n[None, :], mask=m_y, other=0.).to(tl.float32)
        out = (res + out.to(tl.float32)).to(dt)
    tl.store(y + o_m[:, None].to(tl.int64) * N + o_n[None, :], out, mask=m_y)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 index: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                 norm_bias: torch.Tensor | None = None, eps: float = 1e-6, swiglu: bool = False,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + act(rms_norm(x) @ weight.T + bias) in one launch (forward only; module docstring).

    Args:
        x: [..., K] fp16 / bf16 / fp32 on a Triton device, last dim contiguous; with `index`, a table [V, K] whose
            rows index [...] (long, in range: not checked, no host read) are the input (an embedding lookup).
        weight: [N_w, K] ([out, in] as nn.Linear), last dim contiguous; bias [N_w] or None.
        norm_weight, norm_bias: [K] or None: x goes through RMSNorm (eps) first when norm_weight is given.
        swiglu: y = silu(y[..., :N]) * y[..., N:], N = N_w / 2 (weight rows: gate, then up); else N = N_w.
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
    if norm_bias is not None and norm_weight is None:
        raise ValueError("small_linear: norm_bias needs norm_weight")
    ts = [t for t in (weight, bias, norm_weight, norm_bias, residual) if t is not None]
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or any(t.dtype != x.dtype for t in ts):
        raise ValueError(f"small_linear expects fp16, bf16 or fp32 tensors of one dtype, got x {x.dtype} and "
                         f"{sorted({str(t.dtype) for t in ts})}")
    if any(t.device != x.device for t in ts) or (index is not None and index.device != x.device):
        raise ValueError("small_linear expects every tensor on one device")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("small_linear expects x, weight and residual with a contiguous last dim")
    if index is not None:
        x2, idx = x, index.reshape(-1).contiguous()
    else:
        x2, idx = _rows(x), None
    M = idx.shape[0] if idx is not None else x2.shape[0]
    r2 = _rows(residual) if residual is not None else None
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
            IEEE=x.dtype == torch.float32, BM=BM, BN=BN, BK=BK, num_warps=4, num_stages=3)
    return y.view(*lead, N)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., C] as [M, C] rows at one stride with a contiguous last dim: a view where one exists, else a copy."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:                              # rows at more than one stride
        return t.reshape(-1, t.shape[-1]).contiguous()
