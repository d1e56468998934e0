"""Tree attention for the full-attention layers of a tree-verify step (Triton).

One program per (M-tile, batch x kv-head, split). The M-tile packs the (node, q-head-in-group)
rows of one kv head, so a KV tile is read once for all G q heads (GQA packing). Split s streams its
chunk of the prefix with no mask; the last split also streams the tree keys under the ancestor
bitmask, skipping key blocks past the tile's last node (topological order: ancestors come first).
With more than one split, a merge kernel combines the fp32 partials by their log-sum-exp.
"""
import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tfm_kernels.pack_bits import pack_bits

LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(acc, m_i, l_i, b_q, b_kt, b_v, visible, qk_scale, DOT_PREC: tl.constexpr):
    # b_q [BM, BD], b_kt [BD, BN], b_v [BN, BD], visible [BM, BN]; m_i, l_i in the log2 domain.
    b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC) * qk_scale
    b_s = tl.where(visible, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, 1))
    # Rows with nothing visible yet keep m = -inf; shift by 0 so that exp2 gives 0, never NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    b_p = tl.exp2(b_s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def tree_attention_fwd_kernel(
    q, k_tree, v_tree, k_prefix, v_prefix, prefix_len, anc_bits, num_nodes,
    o, lse, qk_scale,
    s_qb, s_qn, s_qh, s_tb, s_tn, s_th, s_vb, s_vn, s_vh, s_pb, s_pn, s_ph, s_ab, s_an,
    N, Hkv, CHUNK,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PARTIAL: tl.constexpr, STORE_LSE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_m, i_bh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // Hkv, i_bh % Hkv
    L = tl.load(prefix_len + i_b).to(tl.int32)
    n = tl.load(num_nodes + i_b).to(tl.int32)
    # Packed rows: r = node * G + g, q head = i_h * G + g.
    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_node = o_r // G
    o_hq = i_h * G + o_r % G
    m_row = o_node < n
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    i_b64 = i_b.to(tl.int64)

    p_q = q + i_b64 * s_qb + o_node[:, None] * s_qn + o_hq[:, None] * s_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Prefix keys of this split: every row sees all of them.
    kp = k_prefix + i_b64 * s_pb + i_h * s_ph
    vp = v_prefix + i_b64 * s_pb + i_h * s_ph
    lo = i_s * CHUNK
    hi = tl.minimum(lo + CHUNK, L)
    for start in range(lo, hi, BLOCK_N):
        o_n = start + tl.arange(0, BLOCK_N)
        m_n = o_n < hi
        b_kt = tl.load(kp + o_n[None, :] * s_pn + o_d[:, None], mask=m_n[None, :] & m_d[:, None], other=0.0)
        b_v = tl.load(vp + o_n[:, None] * s_pn + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, b_q, b_kt, b_v, m_n[None, :], qk_scale, DOT_PREC)

    # Tree keys (last split only), masked by the inclusive ancestor bitmask.
    if i_s == tl.num_programs(2) - 1:
        kt = k_tree + i_b64 * s_tb + i_h * s_th
        vt = v_tree + i_b64 * s_vb + i_h * s_vh
        pa = anc_bits + i_b64 * s_ab + o_node[:, None] * s_an
        hi_t = tl.minimum(n, (i_m * BLOCK_M + BLOCK_M - 1) // G + 1)
        for start in range(0, hi_t, BLOCK_N):
            o_n = start + tl.arange(0, BLOCK_N)
            m_n = o_n < n
            b_kt = tl.load(kt + o_n[None, :] * s_tn + o_d[:, None], mask=m_n[None, :] & m_d[:, None], other=0.0)
            b_v = tl.load(vt + o_n[:, None] * s_vn + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0)
            m_rn = m_row[:, None] & m_n[None, :]
            b_w = tl.load(pa + (o_n // 32)[None, :], mask=m_rn, other=0)  # [BM, BN] int32 words
            visible = (((b_w >> (o_n % 32)[None, :]) & 1) != 0) & m_rn
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, b_q, b_kt, b_v, visible, qk_scale, DOT_PREC)

    # Padding nodes: o = 0, lse = -inf (they may have seen the prefix through zeroed queries).
    l_one = tl.where(l_i > 0, l_i, 1.0)
    b_o = tl.where(m_row[:, None], acc / l_one[:, None], 0.0)
    b_lse = tl.where(m_row & (l_i > 0), (m_i + tl.log2(l_one)) * 0.6931471805599453, float("-inf"))
    m_st = o_node < N
    # o / lse are [S, B, N, Hq, D] / [S, B, N, Hq] fp32 partials, or the final [B, N, Hq, D] / [B, N, Hq].
    i_sb = i_s * (tl.num_programs(1) // Hkv) + i_b if PARTIAL else i_b
    o_row = (i_sb * N + o_node).to(tl.int64) * (Hkv * G) + o_hq
    tl.store(o + o_row[:, None] * D + o_d[None, :], b_o.to(o.dtype.element_ty), mask=m_st[:, None] & m_d[None, :])
    if STORE_LSE:
        tl.store(lse + o_row, b_lse, mask=m_st)


@triton.jit
def tree_attention_merge_kernel(
    o_part, lse_part, o, lse, S, R,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, STORE_LSE: tl.constexpr,
):
    # One program per (b, node, q head) row r of R = B * N * Hq rows.
    i_r = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < S
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_l = tl.load(lse_part + o_s * R + i_r, mask=m_s, other=float("-inf"))  # [BS]
    mx = tl.max(b_l, 0)
    w = tl.exp(b_l - tl.where(mx == float("-inf"), 0.0, mx))
    tot = tl.sum(w, 0)
    b_o = tl.load(o_part + (o_s[:, None] * R + i_r) * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
    tot_one = tl.where(tot > 0, tot, 1.0)
    b_o = tl.sum(b_o * w[:, None], 0) / tot_one
    tl.store(o + i_r * D + o_d, b_o.to(o.dtype.element_ty), mask=m_d)
    if STORE_LSE:
        tl.store(lse + i_r, tl.where(tot > 0, mx + tl.log(tot_one), float("-inf")))


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True)
class TreeAttentionTuning:
    """Launch parameters of `tree_attention`; `TreeAttentionTuning.for_shape(N, G, D, itemsize)` is the default.

    block_m: packed (node, q head) rows per program; block_n: keys per step (both powers of 2 >= 16);
    num_warps, num_stages: launch options; num_splits: prefix splits (split-KV and a log-sum-exp merge),
    None: enough programs for ~2 waves while each split keeps >= 4 key blocks.
    """
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int | None = None

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            x = getattr(self, name)
            if x < 16 or x & (x - 1):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {x}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 or None, got {self.num_splits}")

    @classmethod
    def for_shape(cls, N: int, G: int, D: int, itemsize: int = 2) -> "TreeAttentionTuning":
        """The default for N nodes, G q heads per kv head, head size D, inputs of `itemsize` bytes.

        Many packed rows (>= 256, 16-bit, D <= 256) are compute bound: 128-row tiles, 8 warps, 3 stages.
        Fewer rows: the smallest of 16 / 32 / 64-row tiles that holds them, 2 stages. The pipelined K and V
        tiles must fit in shared memory next to the Q tile, so wide heads take fewer keys per step.
        """
        rows, block_d = N * G, max(16, triton.next_power_of_2(D))
        big = rows >= 256 and itemsize <= 2 and block_d <= 256
        block_m = 128 if big else 16 if rows <= 16 else 32 if rows <= 32 else 64
        block_n = 64 if block_d * itemsize <= 256 else 32 if block_d * itemsize <= 1024 else 16
        warps = 8 if block_m >= 128 or (block_m >= 64 and block_d * itemsize >= 1024) else 4
        return cls(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=3 if big else 2)


def launch_config(B, N, G, Hkv, D, Lmax, device, tuning: TreeAttentionTuning) -> dict:
    """The launch of `tuning` on these shapes: tiles, warps, stages, the split count and each split's prefix
    chunk (a multiple of BLOCK_N). A function of shapes only (no sync, CUDA-graph safe)."""
    rows = N * G
    block_m, block_n = tuning.block_m, tuning.block_n
    base = triton.cdiv(rows, block_m) * B * Hkv
    num_splits = tuning.num_splits
    if num_splits is None:
        sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
        # Fill ~2 waves, but keep >= 4 key blocks per split so the loop still pipelines.
        num_splits = max(1, min(triton.cdiv(2 * sms, base), triton.cdiv(Lmax, 4 * block_n)))
    chunk = max(block_n, triton.cdiv(triton.cdiv(max(Lmax, 1), num_splits), block_n) * block_n)
    num_splits = max(1, triton.cdiv(Lmax, chunk))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)), num_splits=num_splits,
                chunk=chunk, num_warps=tuning.num_warps, num_stages=tuning.num_stages)


def tree_attention_fwd(q, k_tree, v_tree, k_prefix, v_prefix, prefix_len, anc_bits, num_nodes,
                       sm_scale, return_lse, cfg):
    B, N, Hq, D = q.shape
    Hkv, G = k_tree.shape[2], Hq // k_tree.shape[2]
    S, dev = cfg["num_splits"], q.device
    o = torch.empty(B, N, Hq, D, dtype=q.dtype, device=dev)
    lse = torch.empty(B, N, Hq, dtype=torch.float32, device=dev) if return_lse else None
    if S > 1:
        o_k = torch.empty(S, B, N, Hq, D, dtype=torch.float32, device=dev)
        lse_k = torch.empty(S, B, N, Hq, dtype=torch.float32, device=dev)
    else:
        o_k, lse_k = o, lse
    grid = (triton.cdiv(N * G, cfg["BLOCK_M"]), B * Hkv, S)
    tree_attention_fwd_kernel[grid](
        q, k_tree, v_tree, k_prefix, v_prefix, prefix_len, anc_bits, num_nodes,
        o_k, lse_k, sm_scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k_tree.stride(0), k_tree.stride(1), k_tree.stride(2),
        v_tree.stride(0), v_tree.stride(1), v_tree.stride(2),
        k_prefix.stride(0), k_prefix.stride(1), k_prefix.stride(2), anc_bits.stride(0), anc_bits.stride(1),
        N, Hkv, cfg["chunk"],
        G=G, D=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
        PARTIAL=S > 1, STORE_LSE=S > 1 or return_lse,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if S > 1:
        R, block_s = B * N * Hq, triton.next_power_of_2(S)
        tree_attention_merge_kernel[(R,)](
            o_k, lse_k, o, lse, S, R, D=D, BLOCK_D=cfg["BLOCK_D"], BLOCK_S=block_s, STORE_LSE=return_lse,
            num_warps=max(1, min(8, block_s * cfg["BLOCK_D"] // 2048)),
        )
    return (o, lse) if return_lse else o


def tree_attention(
    q: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    prefix_len: torch.Tensor,
    anc: torch.Tensor,
    num_nodes: torch.Tensor,
    sm_scale: float | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    tuning: TreeAttentionTuning | None = None,
):
    r"""Attention of each draft-tree node over the full prefix and its ancestors (itself included).

    `o[b, i, h] = softmax_j(sm_scale * q[b, i, h] . k_j) @ v_j` over j in {prefix 0..prefix_len[b]-1}
    followed by the tree nodes j with `anc[b, i, j]`; fp32 online softmax, GQA (q head h reads
    kv head `h // (Hq // Hkv)`). No host sync: the split count depends on shapes only, so the
    call can be captured in a CUDA graph.

    Args:
        q: [B, N, Hq, D] (already RoPE'd at positions prefix_len + depth). fp16 / bf16 / fp32.
        k_tree, v_tree: [B, N, Hkv, D], the nodes' own keys and values, same dtype as q (each its own strides, the
            last dim contiguous: e.g. v a view of a fused qkv projection's output, read in place).
        k_prefix, v_prefix: [B, Lmax, Hkv, D], contiguous committed KV (Lmax may be 0).
        prefix_len: int [B], 0 <= prefix_len[b] <= Lmax.
        anc: inclusive ancestor relation of each tree, either bool [B, N, N] or a bitmask
            int32 [B, N, ceil(N/32)] (bit j % 32 of word j // 32) / int64 [B, N, ceil(N/64)];
            see `tfm_kernels.tree_utils.ancestor_mask` / `ancestor_bitmask`. Nodes must be in
            topological order (ancestors have smaller indices). A bool mask is packed per call:
            build the bitmask once per step and share it across layers.
        num_nodes: int [B], n_b <= N; nodes >= n_b are padding.
        sm_scale: Default: D ** -0.5.
        return_lse: also return the natural-log log-sum-exp of the scores.
        num_splits: prefix split count (split-KV + LSE merge), in place of `tuning.num_splits`.
            Default: enough to fill ~2 waves.
        tuning: launch parameters. Default: `TreeAttentionTuning.for_shape(N, Hq // Hkv, D, q.element_size())`.
    Returns:
        o: [B, N, Hq, D] in q.dtype, zero on padding nodes;
        lse: fp32 [B, N, Hq], -inf on padding nodes (only if `return_lse`).

    Example::

        >>> parent = torch.tensor([[-1, 0, 0, 1]])
        >>> anc = ancestor_bitmask(parent)                      # [1, 4, 1] int32
        >>> o = tree_attention(q, kt, vt, kp, vp, torch.tensor([L]), anc, torch.tensor([4]))
    """
    if q.dim() != 4 or k_tree.dim() != 4 or k_prefix.dim() != 4:
        raise ValueError(f"q, k_tree, k_prefix must be 4-D, got {q.dim()}, {k_tree.dim()}, {k_prefix.dim()}")
    B, N, Hq, D = q.shape
    Hkv = k_tree.shape[2]
    if k_tree.shape != (B, N, Hkv, D) or v_tree.shape != k_tree.shape:
        raise ValueError(f"k_tree/v_tree must be [B, N, Hkv, D] = {(B, N, Hkv, D)}, got "
                         f"{tuple(k_tree.shape)} / {tuple(v_tree.shape)}")
    if k_prefix.shape[0] != B or k_prefix.shape[2:] != (Hkv, D) or v_prefix.shape != k_prefix.shape:
        raise ValueError(f"k_prefix/v_prefix must be [B, Lmax, Hkv, D] with B={B}, Hkv={Hkv}, D={D}, got "
                         f"{tuple(k_prefix.shape)} / {tuple(v_prefix.shape)}")
    if Hq % Hkv != 0:
        raise ValueError(f"Hq must be a multiple of Hkv, got Hq={Hq}, Hkv={Hkv}")
    if not (q.dtype == k_tree.dtype == v_tree.dtype == k_prefix.dtype == v_prefix.dtype):
        raise ValueError("q, k_tree, v_tree, k_prefix, v_prefix must share one dtype")
    if tuple(prefix_len.shape) != (B,) or tuple(num_nodes.shape) != (B,):
        raise ValueError(f"prefix_len and num_nodes must be [B] = [{B}], got "
                         f"{tuple(prefix_len.shape)} and {tuple(num_nodes.shape)}")
    anc_bits = _as_bitmask(anc, B, N)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_tree, v_tree = (t if t.stride(-1) == 1 else t.contiguous() for t in (k_tree, v_tree))   # each its own strides
    k_prefix, v_prefix = _same_layout(k_prefix, v_prefix)
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    tuning = TreeAttentionTuning.for_shape(N, Hq // Hkv, D, q.element_size()) if tuning is None else tuning
    if not isinstance(tuning, TreeAttentionTuning):
        raise TypeError(f"tuning must be a TreeAttentionTuning, got {type(tuning).__name__}")
    if num_splits is not None:
        tuning = dataclasses.replace(tuning, num_splits=num_splits)
    cfg = launch_config(B, N, Hq // Hkv, Hkv, D, k_prefix.shape[1], q.device, tuning)
    return tree_attention_fwd(q, k_tree, v_tree, k_prefix, v_prefix, prefix_len, anc_bits, num_nodes,
                              scale, return_lse, cfg)


def _as_bitmask(anc, B, N):
    if anc.dtype == torch.bool:
        if tuple(anc.shape) != (B, N, N):
            raise ValueError(f"a bool anc must be [B, N, N] = {(B, N, N)}, got {tuple(anc.shape)}")
        return pack_bits(anc if anc.stride(-1) == 1 else anc.contiguous())     # one launch
    if anc.dtype == torch.int64:
        anc = anc.contiguous().view(torch.int32)  # little-endian: int64 word w = int32 words 2w, 2w+1
    if anc.dtype != torch.int32:
        raise ValueError(f"anc must be bool, int32 or int64, got {anc.dtype}")
    if anc.dim() != 3 or anc.shape[:2] != (B, N) or anc.shape[2] * 32 < N:
        raise ValueError(f"a bitmask anc must be [B, N, >= ceil(N/32)] int32 with B={B}, N={N}, "
                         f"got {tuple(anc.shape)}")
    return anc if anc.stride(-1) == 1 else anc.contiguous()


def _same_layout(k, v):
    if k.stride(-1) != 1 or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    return k, v
