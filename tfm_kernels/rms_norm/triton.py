"""RMSNorm forward in one launch (Triton): y = round(weight * round(x / rms(x))) (+ bias, rounded), or with
`one_plus` y = round(x / rms(x) * (1 + weight)), then with `gate` round(y * silu(gate)); one row per program, math
in fp32. `add_rms_norm` first adds a residual (s = round(x + r), written too), where a block's output joins the
residual stream just before the next norm: one launch for torch's add and norm.

The roundings are those of `tfm_runtime.models.common.RMSNorm` and `tfm_runtime.fast.dense.rms_norm` (normalise in
fp32, round to x's dtype, multiply by the weight and round, add the bias and round), or of
`tfm_runtime.fast.hybrid.rms_norm_1p` (one rounding) and `gated_rms_norm`, so they differ only in the order of the
fp32 sum of squares.
Torch spends six to eight launches on each; the fast targets run two to four norms per layer, where launches are
most of a small model's step (the Weaver's steps fold their norms into `tfm_kernels.small_linear`). Forward only:
training keeps the module's autograd path.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(x, idx, w, b, z, r, s, y, D, NB, s_xa, s_xb, NZ, s_za, s_zb, eps, HAS_BIAS: tl.constexpr,
                        ONE_PLUS: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr, HAS_IDX: tl.constexpr,
                        BD: tl.constexpr):
    """Row `program_id(0)` of x [N, D] -> y [N, D] (r, s, y row-major; row i of x at (i // NB) * s_xa +
    (i % NB) * s_xb, its last dim contiguous; HAS_IDX: at idx[i] * s_xa, rows gathered from a table; row i of z at
    (i // NZ) * s_za + (i % NZ) * s_zb, its last dim contiguous); w, b [D]; BD = next power of 2 >= D.
    HAS_RES: the row normalised is s = round(x + r), also written (a residual add before the norm).
    ONE_PLUS: y = round(x / rms(x) * (1 + w)), one rounding (Qwen3.5's norm); else the module's roundings.
    HAS_GATE: then y = round(y * silu(z)), silu in fp32 (the GDN output norm)."""
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BD)
    m = o < D
    if HAS_IDX:
        x_off = tl.load(idx + row).to(tl.int64) * s_xa
    else:
        x_off = (row // NB) * s_xa + (row % NB) * s_xb
    xr = tl.load(x + x_off + o, mask=m, other=0.).to(tl.float32)
    if HAS_RES:
        sr = (xr + tl.load(r + row * D + o, mask=m, other=0.).to(tl.float32)).to(y.dtype.element_ty)
        tl.store(s + row * D + o, sr, mask=m)
        xr = sr.to(tl.float32)
    n = xr * tl.rsqrt(tl.sum(xr * xr, axis=0) / D + eps)
    wr = tl.load(w + o, mask=m, other=0.).to(tl.float32)
    if ONE_PLUS:
        out = (n * (1.0 + wr)).to(y.dtype.element_ty)
    else:
        out = (n.to(y.dtype.element_ty).to(tl.float32) * wr).to(y.dtype.element_ty)   # normalised, rounded, weighted
    if HAS_BIAS:
        out = (out.to(tl.float32) + tl.load(b + o, mask=m, other=0.).to(tl.float32)).to(y.dtype.element_ty)
    if HAS_GATE:
        zr = tl.load(z + (row // NZ) * s_za + (row % NZ) * s_zb + o, mask=m, other=0.).to(tl.float32)
        out = (out.to(tl.float32) * (zr / (1.0 + tl.exp(-zr)))).to(y.dtype.element_ty)
    tl.store(y + row * D + o, out, mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-6,
             one_plus: bool = False, gate: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the last dim, forward only (no autograd).

    Args:
        x: [..., D] fp16 / bf16 / fp32 on a Triton device, D <= 16384 (a strided 2-D or 3-D view whose last dim is
            contiguous is read in place).
        weight, bias: [D] of x's dtype (bias may be None).
        one_plus: scale by (1 + weight) in fp32 and round once (Qwen3-Next / Qwen3.5) instead of rounding the
            normalised x before the weight (Llama, Qwen3, the drafters).
        gate: [..., D] like x, or None: then y * silu(gate) in fp32, rounded (Qwen3.5's gated GDN output norm);
            read in place where x would be (e.g. z [T, HV, dv], columns of a fused in-projection's output).
    Returns:
        y: [..., D] of x's dtype, contiguous.
    """
    _check(x, weight, bias, gate, "gate")
    return _launch(x, weight, bias, eps, one_plus, gate, None)


def rms_norm_rows(table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """`rms_norm(table[index], ...)` in one launch, the rows read from the table in place (an embedding lookup and
    its norm): table [V, D] with a contiguous last dim, index long [...] (0 <= index < V, not checked: no host
    read) -> [..., D] of the table's dtype, contiguous."""
    _check(table, weight, bias, None, "")
    D = table.shape[-1]
    if table.dim() != 2 or table.stride(-1) != 1 or index.dtype not in (torch.int32, torch.int64) \
            or index.device != table.device:
        raise ValueError(f"rms_norm_rows expects a table [V, D] with a contiguous last dim and an int index on its "
                         f"device, got {tuple(table.shape)} (strides {table.stride()}) and {index.dtype} on "
                         f"{index.device}")
    idx = index.reshape(-1).contiguous()
    y = torch.empty(idx.shape[0], D, dtype=table.dtype, device=table.device)
    if idx.shape[0]:
        BD = triton.next_power_of_2(D)
        rms_norm_fwd_kernel[(idx.shape[0],)](table, idx, weight.contiguous(), bias if bias is not None else weight, y,
                                             y, y, y, D, 1, table.stride(0), 0, 1, D, 0, eps,
                                             HAS_BIAS=bias is not None, ONE_PLUS=False, HAS_GATE=False,
                                             HAS_RES=False, HAS_IDX=True, BD=BD, num_warps=4 if BD <= 2048 else 8)
    return y.view(*index.shape, D)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 eps: float = 1e-6, one_plus: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (rounded to x's dtype, as torch adds), then `rms_norm(s, ...)`, in one launch (forward
    only): where a block's output is added to the residual stream just before the next norm.

    Args:
        x, residual: [..., D] of one dtype (fp16 / bf16 / fp32) and shape; weight, bias, eps, one_plus as `rms_norm`.
    Returns:
        s, y: [..., D] of x's dtype, contiguous: the sum and its norm.
    """
    _check(x, weight, bias, residual, "residual")
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return s, _launch(x, weight, bias, eps, one_plus, None, (residual, s))


def _check(x, weight, bias, other, name) -> None:
    D = x.shape[-1] if x.dim() else 0
    if x.dim() < 1 or D == 0 or D > 16384:
        raise ValueError(f"rms_norm expects x [..., D] with 0 < D <= 16384, got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"rms_norm expects fp16, bf16 or fp32, got {x.dtype}")
    for pname, p in (("weight", weight), ("bias", bias)):
        if p is not None and (tuple(p.shape) != (D,) or p.dtype != x.dtype or p.device != x.device):
            raise ValueError(f"rms_norm expects {pname} [{D}] {x.dtype} on {x.device}, "
                             f"got {tuple(p.shape)} {p.dtype} on {p.device}")
    if other is not None and (other.shape != x.shape or other.dtype != x.dtype or other.device != x.device):
        raise ValueError(f"rms_norm expects {name} {tuple(x.shape)} {x.dtype} on {x.device}, "
                         f"got {tuple(other.shape)} {other.dtype} on {other.device}")


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [..., D] (x or the gate) -> (x or a contiguous copy, NB, s_a, s_b): its i-th row of D at (i // NB) * s_a +
    (i % NB) * s_b. Rows at one stride (e.g. the halves of a fused projection's output) or a 3-D [A, B, D] view with
    its last dim contiguous (e.g. the heads of q split from a fused q/k/v projection, GDN's z [T, HV, dv]) are read
    in place."""
    D = x.shape[-1]
    if x.stride(-1) == 1:
        if x.dim() == 3 and x.shape[0] * x.shape[1] > 0:
            return x, x.shape[1], x.stride(0), x.stride(1)
        if x.dim() <= 2:
            return x, 1, (x.stride(0) if x.dim() == 2 else D), 0
    x2 = x.reshape(-1, D).contiguous()
    return x2, 1, D, 0


def _launch(x, weight, bias, eps, one_plus, gate, res) -> torch.Tensor:
    """The kernel over x's rows; res = (residual, s) for `add_rms_norm`."""
    D = x.shape[-1]
    xr, NB, s_xa, s_xb = _rows(x)
    N = x.numel() // D
    y = torch.empty(N, D, dtype=x.dtype, device=x.device)
    z2, NZ, s_za, s_zb = _rows(gate) if gate is not None else (y, 1, D, 0)
    r2, s2 = (res[0].reshape(-1, D).contiguous(), res[1].view(-1, D)) if res is not None else (y, y)
    if N:
        BD = triton.next_power_of_2(D)
        rms_norm_fwd_kernel[(N,)](xr, xr, weight.contiguous(), bias if bias is not None else weight, z2, r2, s2, y,
                                  D, NB, s_xa, s_xb, NZ, s_za, s_zb, eps, HAS_BIAS=bias is not None,
                                  ONE_PLUS=one_plus, HAS_GATE=gate is not None, HAS_RES=res is not None,
                                  HAS_IDX=False, BD=BD, num_warps=4 if BD <= 2048 else 8)
    return y.view(x.shape)
