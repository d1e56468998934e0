"""Inclusive ancestor masks of padded parent rows in one launch (Triton): what `ref.ancestors_ref` does in about
two launches per level, and what a closure by repeated squaring does in about twelve.

Each program takes BR rows of one tree and follows their parent chains `max_depth` steps, one load of a parent per
row and step, marking the node reached in a [BR, n] tile. Only compares and copies: equal to the reference.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def tree_ancestors_kernel(parents, s_pb, out, n, max_depth, BR: tl.constexpr, BN: tl.constexpr):
    """Rows program_id(1) * BR .. of tree program_id(0): parents [B, n] (rows s_pb apart), out [B, n, n] int8."""
    b, i_r = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_r = i_r * BR + tl.arange(0, BR)
    o_c = tl.arange(0, BN)
    m_r = o_r < n
    cur = tl.where(m_r, o_r, -1).to(tl.int64)                                                    # [BR]
    acc = o_c[None, :] == cur[:, None]                                                           # [BR, BN]
    for _ in range(max_depth):
        cur = tl.load(parents + b * s_pb + cur, mask=cur >= 0, other=-1).to(tl.int64)
        acc = acc | (o_c[None, :] == cur[:, None])
    tl.store(out + (b * n + o_r[:, None]) * n + o_c[None, :], acc.to(tl.int8),
             mask=m_r[:, None] & (o_c < n)[None, :])


def tree_ancestors(parents: torch.Tensor, max_depth: int, block_rows: int = 16) -> torch.Tensor:
    r"""Inclusive ancestor masks, as `ref.ancestors_ref`.

    Args:
        parents: [B, n] int or long, -1 at roots and padding, each parent before its child; rows may lie apart (a
            view of wider rows), the last dim contiguous.
        max_depth: the trees' depth bound (e.g. the drafter's lookahead).
    Returns:
        [B, n, n] bool: row i True at i and its ancestors.
    """
    if parents.dim() != 2 or parents.stride(-1) != 1 or parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parents must be [B, n] int32/int64 with a contiguous last dim, got {tuple(parents.shape)} "
                         f"{parents.dtype} strides {parents.stride()}")
    B, n = parents.shape
    out = torch.empty(B, n, n, dtype=torch.bool, device=parents.device)
    tree_ancestors_kernel[(B, triton.cdiv(n, block_rows))](parents, parents.stride(0), out.view(torch.int8), n,
                                                           max_depth, BR=block_rows,
                                                           BN=triton.next_power_of_2(n), num_warps=4)
    return out
