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


@triton.jit
def _rotate_heads(x, s_t, s_h, t, nh, D, HALF, c1, c2, s1, s2, w, eps, NORM: tl.constexpr, BH: tl.constexpr,
                  BR: tl.constexpr, BP: tl.constexpr):
    """Token t's nh heads of x (strides s_t, s_h, 1): the first 2 * HALF dims rotated (y1, y2 [BH, BR] in x's
    dtype), the rest as they are (xp [BH, BP]); with their masks. NORM 1: each head RMS-normalised over its D values
    first (fp32 statistics; normalised and rounded, times the weight w [D] and rounded, as RMSNorm); NORM 2: times
    (1 + w) in fp32 and rounded once (the Qwen3.5 form)."""
    o_h, o_r, o_p = tl.arange(0, BH), tl.arange(0, BR), tl.arange(0, BP)
    m = (o_h < nh)[:, None] & (o_r < HALF)[None, :]
    m_p = (o_h < nh)[:, None] & (o_p < D - 2 * HALF)[None, :]
    row = x + t * s_t + o_h[:, None] * s_h
    x1 = tl.load(row + o_r[None, :], mask=m, other=0.).to(tl.float32)
    x2 = tl.load(row + HALF + o_r[None, :], mask=m, other=0.).to(tl.float32)
    xp = tl.load(row + 2 * HALF + o_p[None, :], mask=m_p, other=0.)
    dt = x.dtype.element_ty
    if NORM > 0:
        xpf = xp.to(tl.float32)
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xpf * xpf, axis=1)           # [BH]
        r = tl.rsqrt(ss / D + eps)[:, None]
        w1 = tl.load(w + o_r, mask=o_r < HALF, other=0.).to(tl.float32)[None, :]
        w2 = tl.load(w + HALF + o_r, mask=o_r < HALF, other=0.).to(tl.float32)[None, :]
        wp = tl.load(w + 2 * HALF + o_p, mask=o_p < D - 2 * HALF, other=0.).to(tl.float32)[None, :]
        if NORM == 1:
            x1 = (w1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (w2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xp = (wp * (xpf * r).to(dt).to(tl.float32)).to(dt)
        else:
            x1 = (x1 * r * (1.0 + w1)).to(dt).to(tl.float32)
            x2 = (x2 * r * (1.0 + w2)).to(dt).to(tl.float32)
            xp = (xpf * r * (1.0 + wp)).to(dt)
    y1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    return y1, y2, xp, m, m_p


@triton.jit
def _store_heads(dst, s_h, y1, y2, xp, m, m_p, HALF, BH: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr):
    """y1, y2, xp of `_rotate_heads` to dst + head * s_h (a head's D values contiguous)."""
    o_h, o_r, o_p = tl.arange(0, BH), tl.arange(0, BR), tl.arange(0, BP)
    row = dst + o_h[:, None] * s_h
    tl.store(row + o_r[None, :], y1, mask=m)
    tl.store(row + HALF + o_r[None, :], y2, mask=m)
    tl.store(row + 2 * HALF + o_p[None, :], xp, mask=m_p)


@triton.jit
def rope_cache_kernel(q, k, v, cos, sin, pos, slots, q_out, k_out, k_cache, v_cache, q_w, k_w, eps,
                      q_st, q_sh, k_st, k_sh, v_st, v_sh, kc_sh, kc_ss, vc_sh, vc_ss, NQ, NK, D, HALF,
                      NORM: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr,
                      BD: tl.constexpr):
    """Program t: q_out[t], k_out[t] rotated (first 2 * HALF dims; the rest copied) at table row pos[t], each head
    first normalised with weight q_w / k_w where NORM > 0; k_out[t] and v[t] also into cache slot slots[t]
    ([heads, slots, D] caches, strides *_sh, *_ss, 1)."""
    t = tl.program_id(0).to(tl.int64)
    p_c = tl.load(pos + t) * (2 * HALF)
    slot = tl.load(slots + t)
    o_r = tl.arange(0, BR)
    c1 = tl.load(cos + p_c + o_r, mask=o_r < HALF, other=0.).to(tl.float32)[None, :]
    c2 = tl.load(cos + p_c + HALF + o_r, mask=o_r < HALF, other=0.).to(tl.float32)[None, :]
    s1 = tl.load(sin + p_c + o_r, mask=o_r < HALF, other=0.).to(tl.float32)[None, :]
    s2 = tl.load(sin + p_c + HALF + o_r, mask=o_r < HALF, other=0.).to(tl.float32)[None, :]
    y1, y2, xp, m, m_p = _rotate_heads(q, q_st, q_sh, t, NQ, D, HALF, c1, c2, s1, s2, q_w, eps, NORM, BQ, BR, BP)
    _store_heads(q_out + t * NQ * D, D, y1, y2, xp, m, m_p, HALF, BQ, BR, BP)
    y1, y2, xp, m, m_p = _rotate_heads(k, k_st, k_sh, t, NK, D, HALF, c1, c2, s1, s2, k_w, eps, NORM, BK, BR, BP)
    _store_heads(k_out + t * NK * D, D, y1, y2, xp, m, m_p, HALF, BK, BR, BP)
    _store_heads(k_cache + slot * kc_ss, kc_sh, y1, y2, xp, m, m_p, HALF, BK, BR, BP)
    o_h, o_d = tl.arange(0, BK), tl.arange(0, BD)
    m_v = (o_h < NK)[:, None] & (o_d < D)[None, :]
    xv = tl.load(v + t * v_st + o_h[:, None] * v_sh + o_d[None, :], mask=m_v, other=0.)
    tl.store(v_cache + o_h[:, None] * vc_sh + slot * vc_ss + o_d[None, :], xv, mask=m_v)


def rope_cache(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               pos: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
               q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
               one_plus: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Rotate q and k of T tokens by position and write k and v into their K/V cache slots, in one launch (forward
    only). The roundings are those of `tfm_runtime.fast.dense.rotate` (x * cos and rotate_half(x) * sin each rounded
    to x's dtype, then their sum), which with the two `index_copy_` writes takes about twelve launches. With q_norm
    and k_norm ([D] weights of q's dtype: Qwen3-family attention; q_norm not needed without q), each head of q and k
    is first RMS-normalised over its D values (eps) as `tfm_runtime.fast.dense.rms_norm` (one_plus: `rms_norm_1p`)
    does: two launches fewer.

    Args:
        q: [T, nq, D] or None (keys and values only); k, v: [T, nk, D]; fp16 / bf16 / fp32 on a Triton device,
            last dims contiguous.
        cos, sin: tables [P, R] of q's dtype, R <= D even (R < D: partial rotary, the last D - R dims unrotated).
        pos: [T] long, the table row of each token; slots: [T] long, its cache slot.
        k_cache, v_cache: [nk, S, D] of q's dtype, last dim contiguous (one layer of the target's cache).
        q_norm, k_norm: [D] of q's dtype, or None; eps, one_plus: the norm's.
    Returns:
        q, k: [T, nq, D] (None without q), [T, nk, D] (normalised and) rotated, contiguous (k as written to the
            cache).
    """
    no_q = q is None
    q = k[:, :0] if no_q else q                                    # no query heads: nothing rotated or written
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[::2] != k.shape[::2] or 0 in k.shape:
        raise ValueError(f"rope_cache expects q [T, nq, D], k and v [T, nk, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    T, NQ, D = q.shape
    NK, R = k.shape[1], cos.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"rope_cache expects fp16, bf16 or fp32, got {q.dtype}")
    if cos.dim() != 2 or sin.shape != cos.shape or R % 2 or not 0 < R <= D:
        raise ValueError(f"rope_cache expects cos, sin tables [P, R] with R even, 0 < R <= {D}, got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    for name, t, shape in (("pos", pos, (T,)), ("slots", slots, (T,))):
        if tuple(t.shape) != shape or t.dtype != torch.long:
            raise ValueError(f"rope_cache expects {name} [{T}] long, got {tuple(t.shape)} {t.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 3 or c.shape[0] != NK or c.shape[2] != D or c.stride(-1) != 1:
            raise ValueError(f"rope_cache expects {name} [{NK}, S, {D}] with a contiguous last dim, got "
                             f"{tuple(c.shape)}")
    ts = (q, k, v, cos, sin, pos, slots, k_cache, v_cache)
    if any(t.device != q.device for t in ts) or any(t.dtype != q.dtype for t in (k, v, cos, sin, k_cache, v_cache)):
        raise ValueError("rope_cache expects every tensor on one device and q, k, v, cos, sin and the caches in one "
                         "dtype")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("rope_cache expects q, k, v with a contiguous last dim")
    if (q_norm is not None and k_norm is None) or (k_norm is not None and not no_q and q_norm is None) or any(
            w is not None and (tuple(w.shape) != (D,) or w.dtype != q.dtype or w.device != q.device)
            for w in (q_norm, k_norm)):
        raise ValueError(f"rope_cache expects q_norm (unless q is None) and k_norm [{D}] of q's dtype and device, "
                         f"or neither")
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty(T, NQ, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, NK, D, dtype=q.dtype, device=q.device)
    norm = 0 if k_norm is None else 2 if one_plus else 1
    q_w = (q_norm if q_norm is not None else cos).contiguous()       # cos: any pointer where no norm is read
    k_w = (k_norm if k_norm is not None else cos).contiguous()
    rope_cache_kernel[(T,)](q, k, v, cos, sin, pos, slots, q_out, k_out, k_cache, v_cache, q_w, k_w, eps,
                            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                            NQ, NK, D, R // 2, NORM=norm, BQ=triton.next_power_of_2(max(NQ, 1)),
                            BK=triton.next_power_of_2(NK),
                            BR=triton.next_power_of_2(R // 2), BP=triton.next_power_of_2(max(D - R, 1)),
                            BD=triton.next_power_of_2(D), num_warps=4)
    return None if no_q else q_out, k_out
