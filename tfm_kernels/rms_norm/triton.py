"""RMSNorm forward in one launch (Triton): y = round(weight * round(x / rms(x))) (+ bias, rounded), one row per
program, math in fp32.

The roundings are those of `tfm_runtime.models.common.RMSNorm` (normalise in fp32, round to x's dtype, multiply by
the weight and round, add the bias and round), so the two differ only in the order of the fp32 sum of squares. The
torch module spends seven or eight launches on it; the Weaver's tree build runs eight norms per step in sixteen
sequential steps, where launches are most of the time. Forward only: training keeps the module's autograd path.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(x, w, b, y, D, eps, HAS_BIAS: tl.constexpr, BD: tl.constexpr):
    """Row `program_id(0)` of x [N, D] -> y [N, D] (both row-major); w, b [D]; BD = next power of 2 >= D."""
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BD)
    m = o < D
    xr = tl.load(x + row * D + o, mask=m, other=0.).to(tl.float32)
    inv = tl.rsqrt(tl.sum(xr * xr, axis=0) / D + eps)
    n = (xr * inv).to(y.dtype.element_ty).to(tl.float32)                 # normalised, rounded to x's dtype
    out = (n * tl.load(w + o, mask=m, other=0.).to(tl.float32)).to(y.dtype.element_ty)
    if HAS_BIAS:
        out = (out.to(tl.float32) + tl.load(b + o, mask=m, other=0.).to(tl.float32)).to(y.dtype.element_ty)
    tl.store(y + row * D + o, out, mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of the last dim, forward only (no autograd).

    Args:
        x: [..., D] fp16 / bf16 / fp32 on a Triton device, D <= 16384.
        weight, bias: [D] of x's dtype (bias may be None).
    Returns:
        y: [..., D] of x's dtype, contiguous.
    """
    D = x.shape[-1] if x.dim() else 0
    if x.dim() < 1 or D == 0 or D > 16384:
        raise ValueError(f"rms_norm expects x [..., D] with 0 < D <= 16384, got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"rms_norm expects fp16, bf16 or fp32, got {x.dtype}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (tuple(p.shape) != (D,) or p.dtype != x.dtype or p.device != x.device):
            raise ValueError(f"rms_norm expects {name} [{D}] {x.dtype} on {x.device}, "
                             f"got {tuple(p.shape)} {p.dtype} on {p.device}")
    x2 = x.reshape(-1, D).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        BD = triton.next_power_of_2(D)
        rms_norm_fwd_kernel[(x2.shape[0],)](x2, weight.contiguous(), bias if bias is not None else weight, y, D, eps,
                                            HAS_BIAS=bias is not None, BD=BD, num_warps=4 if BD <= 2048 else 8)
    return y.view(x.shape)
