"""Rotary embeddings of q and k straight from a fused qkv projection, in one launch (Triton).

qkv [B, T, 3, nh, hd] (the projection's output, row-major) -> q, k [B, nh, T, hd] rotated; one program per (b, t)
rotates every head of q and of k. The roundings are those of `tfm_runtime.models.common.apply_rope` on q and k
(x * cos and rotate_half(x) * sin each rounded to x's dtype, then their sum), where torch spends five launches on each
of q and k plus the two layout copies. Optionally cos / sin come from a table by position (the Weaver's node depths:
two gathers fewer) and k and v go straight into the slots of a static K/V cache (two copies fewer). Forward only:
training keeps the torch path and its autograd.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def rope_qk_kernel(qkv, cos, sin, pos, q, k, v, T, NH, HALF, cos_sb, cos_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st,
                   POS: tl.constexpr, WRITE_V: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    """Program (b*T + t): q[b, :, t], k[b, :, t] (and v[b, :, t] with WRITE_V) from qkv[b, t, 0 / 1 (/ 2)]; cos, sin
    at b * cos_sb + t * cos_st, or with POS at row pos[b, t] of the tables (cos_st per row)."""
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // T, bt % T
    o_h, o_d = tl.arange(0, BH), tl.arange(0, BD)
    m = (o_h < NH)[:, None] & (o_d < HALF)[None, :]
    if POS:
        p_c = tl.load(pos + bt) * cos_st
    else:
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
        if j == 0:
            dst = q + ((b * NH + o_h[:, None]) * T + t) * (2 * HALF) + o_d[None, :]
        else:
            dst = k + b * k_sb + o_h[:, None] * k_sh + t * k_st + o_d[None, :]
        tl.store(dst, y1.to(dt), mask=m)
        tl.store(dst + HALF, y2.to(dt), mask=m)
    if WRITE_V:
        src = qkv + bt * 3 * row + 2 * row + o_h[:, None] * (2 * HALF) + o_d[None, :]
        dst = v + b * v_sb + o_h[:, None] * v_sh + t * v_st + o_d[None, :]
        tl.store(dst, tl.load(src, mask=m, other=0.), mask=m)
        tl.store(dst + HALF, tl.load(src + HALF, mask=m, other=0.), mask=m)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
            k_out: torch.Tensor | None = None, v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k of a fused qkv projection, forward only (no autograd).

    Args:
        qkv: [B, T, 3, nh, hd] fp16 / bf16 / fp32 on a Triton device (row-major; hd even).
        cos, sin: [B, T, hd] or [T, hd] of qkv's dtype (the half-split convention of `rope_cos_sin`); with
            `positions`, tables [P, hd] whose row positions[b, t] rotates (b, t).
        positions: [B, T] long in 0..P-1, or None.
        k_out, v_out: [B, nh, T, hd] of qkv's dtype with a contiguous last dim (e.g. the next T slots of a K/V
            cache), or None: k is written to k_out (and returned) instead of a new tensor; v, copied from qkv, to
            v_out.
    Returns:
        q: [B, nh, T, hd] of qkv's dtype, contiguous; k: k_out, or a new tensor like q.
    """
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.shape[-1] % 2 or 0 in qkv.shape:
        raise ValueError(f"rope_qk expects qkv [B, T, 3, nh, hd] with hd even, got {tuple(qkv.shape)}")
    if qkv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"rope_qk expects fp16, bf16 or fp32, got {qkv.dtype}")
    B, T, _, NH, hd = qkv.shape
    if positions is not None:
        if (tuple(positions.shape) != (B, T) or positions.dtype != torch.long or positions.device != qkv.device
                or cos.dim() != 2):
            raise ValueError(f"rope_qk expects positions [{B}, {T}] long on {qkv.device} with cos, sin tables "
                             f"[P, {hd}], got positions {tuple(positions.shape)} {positions.dtype} on "
                             f"{positions.device} and cos {tuple(cos.shape)}")
        want = ((cos.shape[0], hd),)
    else:
        want = ((B, T, hd), (T, hd))
    for name, c in (("cos", cos), ("sin", sin)):
        if tuple(c.shape) not in want or c.dtype != qkv.dtype or c.device != qkv.device:
            raise ValueError(f"rope_qk expects {name} [{B}, {T}, {hd}] or [{T}, {hd}] (a table [P, {hd}] with "
                             f"positions) {qkv.dtype} on {qkv.device}, got {tuple(c.shape)} {c.dtype} on {c.device}")
    for name, o in (("k_out", k_out), ("v_out", v_out)):
        if o is not None and (tuple(o.shape) != (B, NH, T, hd) or o.dtype != qkv.dtype or o.device != qkv.device
                              or o.stride(-1) != 1):
            raise ValueError(f"rope_qk expects {name} [{B}, {NH}, {T}, {hd}] {qkv.dtype} on {qkv.device} with a "
                             f"contiguous last dim, got {tuple(o.shape)} {o.dtype} on {o.device}, strides "
                             f"{o.stride()}")
    qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    cos_sb = T * hd if cos.dim() == 3 else 0
    q = torch.empty(B, NH, T, hd, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty_like(q) if k_out is None else k_out
    v = q if v_out is None else v_out                              # not written without v_out
    rope_qk_kernel[(B * T,)](qkv, cos, sin, q if positions is None else positions, q, k, v, T, NH, hd // 2, cos_sb,
                             hd, *k.stride()[:3], *v.stride()[:3], POS=positions is not None,
                             WRITE_V=v_out is not None, BH=triton.next_power_of_2(NH),
                             BD=triton.next_power_of_2(hd // 2), num_warps=4)
    return q, k
