"""Bool masks packed into int32 words in one launch (Triton): what `tfm_kernels.tree_utils.pack_bits` does in about
ten (a widening copy, a pad, the bit weights, a product, a sum and the sign fold).

Each program packs BR rows: it loads their first BW * 32 columns as a [BR, BW, 32] tile and sums each word's set bits
shifted into place. The bits of a word are distinct powers of two, so the int32 sum carries nothing and bit 31 lands
as the sign bit: equal to the reference exactly.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def pack_bits_kernel(mask, s_mr, out, R, N, W, BR: tl.constexpr, BW: tl.constexpr):
    """Rows program_id(0) * BR ..: mask [R, N] int8 (rows s_mr apart, columns contiguous) -> out [R, W] int32."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_w = tl.arange(0, BW)
    o_b = tl.arange(0, 32)
    cols = o_w[:, None] * 32 + o_b[None, :]                                                  # [BW, 32]
    m_r = o_r < R
    ptr = mask + o_r.to(tl.int64)[:, None, None] * s_mr + cols[None, :, :]
    bits = tl.load(ptr, mask=m_r[:, None, None] & (cols < N)[None, :, :], other=0)          # [BR, BW, 32]
    words = tl.sum((bits != 0).to(tl.int32) << o_b[None, None, :], axis=2)                  # [BR, BW]
    tl.store(out + o_r[:, None] * W + o_w[None, :], words, mask=m_r[:, None] & (o_w < W)[None, :])


def pack_bits(mask: torch.Tensor, block_rows: int = 16) -> torch.Tensor:
    r"""Pack a bool mask into int32 words, as `ref.pack_bits_ref`.

    Args:
        mask: bool [..., N], the last dim contiguous (rows may lie apart: a view of wider rows, flattenable).
    Returns:
        int32 [..., ceil(N / 32)]: bit j % 32 of word j // 32 is mask[..., j].
    """
    if mask.dtype != torch.bool or mask.dim() < 1 or mask.stride(-1) != 1:
        raise ValueError(f"mask must be bool [..., N] with a contiguous last dim, got {mask.dtype} "
                         f"{tuple(mask.shape)} strides {mask.stride()}")
    *lead, N = mask.shape
    W = triton.cdiv(N, 32)
    rows = mask.reshape(-1, N) if mask.dim() != 2 else mask                                  # [R, N] (a view if it can)
    R = rows.shape[0]
    out = torch.empty(R, W, dtype=torch.int32, device=mask.device)
    if R and W:
        pack_bits_kernel[(triton.cdiv(R, block_rows),)](rows.view(torch.int8), rows.stride(0), out, R, N, W,
                                                        BR=block_rows, BW=triton.next_power_of_2(W), num_warps=4)
    return out.view(*lead, W)
