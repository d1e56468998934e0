"""Rotary embeddings of q and k straight from a fused qkv projection, in one launch (Triton).

qkv [B, T, 3, nh, hd] (the projection's output, row-major) -> q, k [B, nh, T, hd] rotated; one program per (b, t)
rotates every head of q and of k. The roundings are those of `tfm_runtime.models.common.apply_rope` on q and k
(x * cos and rotate_half(x) * sin each rounded to x's dtype, then their sum), where torch spends five launches on each
of q and k plus the two layout copies. Forward only: training keeps the torch path and its autograd.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def rope_qk_kernel(qkv, cos, sin, q, k, T, NH, HALF, cos_sb, cos_st,
                   BH: tl.constexpr, BD: tl.constexpr):
    """Program (b*T + t): q[b, :, t], k[b, :, t] from qkv[b, t, 0 / 1]; cos, sin at b * cos_sb + t * cos_st."""
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // T, bt % T
    o_h, o_d = tl.arange(0, BH), tl.arange(0, BD)
    m = (o_h < NH)[:, None] & (o_d < HALF)[None, :]
    p_c = b * cos_sb + t * cos_st
    c1 = tl.load(cos + p_c + o_d, mask=o_d < HALF, other=0.).to(tl.float32)[None, :]
    c2 = tl.load(cos + p_c + HALF + o_d, mask=o_d < HALF, other=0.).to(tl.float32)[None, :]
    s1 = tl.load(sin + p_c + o_d, mask=o_d < HALF, other=0.).to(tl.float32)[None, :]
    s2 = tl.load(sin + p_c + HALF + o_d, mask=o_d < HALF, other=0.).to(tl.float32)[None, :]
    dt = q.dtype.element_ty
    row = NH * 2 * HALF                                                   # one of q, k, v in a qkv row
    for j in tl.static_range(2):
        src = qkv + bt * 3 * row + j * row
        x1 = tl.load(src + o_h[:, None] * (2 * HALF) + o_d[None, :], mask=m, other=0.).to(tl.float32)
        x2 = tl.load(src + o_h[:, None] * (2 * HALF) + HALF + o_d[None, :], mask=m, other=0.).to(tl.float32)
        y1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        dst = (q if j == 0 else k) + ((b * NH + o_h[:, None]) * T + t) * (2 * HALF) + o_d[None, :]
        tl.store(dst, y1.to(dt), mask=m)
        tl.store(dst + HALF, y2.to(dt), mask=m)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k of a fused qkv projection, forward only (no autograd).

    Args:
        qkv: [B, T, 3, nh, hd] fp16 / bf16 / fp32 on a Triton device (row-major; hd even).
        cos, sin: [B, T, hd] or [T, hd] of qkv's dtype (the half-split convention of `rope_cos_sin`).
    Returns:
        q, k: [B, nh, T, hd] of qkv's dtype, contiguous.
    """
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.shape[-1] % 2 or 0 in qkv.shape:
        raise ValueError(f"rope_qk expects qkv [B, T, 3, nh, hd] with hd even, got {tuple(qkv.shape)}")
    if qkv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"rope_qk expects fp16, bf16 or fp32, got {qkv.dtype}")
    B, T, _, NH, hd = qkv.shape
    want = ((B, T, hd), (T, hd))
    for name, c in (("cos", cos), ("sin", sin)):
        if tuple(c.shape) not in want or c.dtype != qkv.dtype or c.device != qkv.device:
            raise ValueError(f"rope_qk expects {name} [{B}, {T}, {hd}] or [{T}, {hd}] {qkv.dtype} on {qkv.device}, "
                             f"got {tuple(c.shape)} {c.dtype} on {c.device}")
    qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    cos_sb = T * hd if cos.dim() == 3 else 0
    q = torch.empty(B, NH, T, hd, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty_like(q)
    rope_qk_kernel[(B * T,)](qkv, cos, sin, q, k, T, NH, hd // 2, cos_sb, hd,
                             BH=triton.next_power_of_2(NH), BD=triton.next_power_of_2(hd // 2), num_warps=4)
    return q, k
