"""Greedy tree acceptance on the device in one launch (Triton), so that a decoder can commit the accepted path and
start its next round before the host reads anything.

One program per tree: it loads the tree's tokens, parents and argmax tokens as [BN] vectors and walks amax - 1
levels down from the root, at each level taking the lowest-numbered child whose token is the argmax at the current
node (as the reference and `tfm_runtime.verify.greedy_path`); once no child matches, the walk stays put.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def greedy_accept_kernel(tokens, parents, best, s_t, s_p, s_b, num_nodes, hold, out,
                         AMAX: tl.constexpr, HAS_HOLD: tl.constexpr, BN: tl.constexpr, BA: tl.constexpr):
    """Row program_id(0): tokens / parents / best [n] (rows s_t / s_p / s_b apart) -> out [AMAX + 3]."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_nodes + b)
    o_n = tl.arange(0, BN)
    m_n = o_n < n
    tok = tl.load(tokens + b * s_t + o_n, mask=m_n, other=-1)                               # [BN]
    par = tl.load(parents + b * s_p + o_n, mask=m_n, other=-1)                              # [BN]
    bst = tl.load(best + b * s_b + o_n, mask=m_n, other=-1)                                 # [BN]
    o_a = tl.arange(0, BA)
    path = tl.zeros([BA], dtype=tl.int64)                                                   # [BA] root at 0
    cur = tl.zeros([], dtype=tl.int64)
    count = tl.full([], 1, dtype=tl.int64)
    for d in range(1, AMAX):
        want = tl.sum(tl.where(o_n == cur, bst, 0))                                         # argmax at cur
        hit = m_n & (o_n > 0) & (par == cur) & (tok == want)                                # [BN]
        child = tl.min(tl.where(hit, o_n, BN)).to(tl.int64)
        step = (child < BN) & (count == d)                                                  # still walking
        cur = tl.where(step, child, cur)
        count = tl.where(step, count + 1, count)
        path = tl.where((o_a == d) & step, cur, path)
    bonus = tl.sum(tl.where(o_n == cur, bst, 0))
    leaf = cur
    if HAS_HOLD:
        held = tl.load(hold + b) != 0
        path = tl.where(held, 0, path)
        count = tl.where(held, 0, count)
        leaf = tl.where(held, -1, leaf)
        bonus = tl.where(held, tl.sum(tl.where(o_n == 0, tok, 0)), bonus)
    row = out + b * (AMAX + 3)
    tl.store(row + o_a, path, mask=o_a < AMAX)
    tl.store(row + AMAX, count)
    tl.store(row + AMAX + 1, leaf)
    tl.store(row + AMAX + 2, bonus)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, best: torch.Tensor, num_nodes: torch.Tensor,
                  amax: int, hold: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    r"""Each tree's greedily accepted path, as `ref.greedy_accept_ref` (the layout of its result there).

    Args:
        tokens, parents, best: [B, n] long on a Triton device, the last dim contiguous (rows may lie apart).
        num_nodes: [B] long, each in 1..n (not checked: no host read).
        amax: the most nodes a path may hold (>= 1).
        hold: [B] bool or None: rows that accept nothing.
        out: [B, amax + 3] long, contiguous, to write into (a static buffer), or None.
    Returns:
        out: [B, amax + 3] long: path (padded with 0), A, leaf, bonus per row.
    """
    B, n = tokens.shape
    for name, t in (("parents", parents), ("best", best)):
        if t.shape != tokens.shape:
            raise ValueError(f"greedy_accept expects {name} {list(tokens.shape)}, got {list(t.shape)}")
    ts = [tokens, parents, best, num_nodes] + ([hold] if hold is not None else [])
    if any(t.dtype != torch.long for t in ts[:4]) or (hold is not None and hold.dtype != torch.bool):
        raise ValueError("greedy_accept expects long tokens, parents, best and num_nodes, and a bool hold")
    if any(t.device != tokens.device for t in ts) or any(t.stride(-1) != 1 for t in ts[:3]):
        raise ValueError("greedy_accept expects tensors on one device with a contiguous last dim")
    if tuple(num_nodes.shape) != (B,) or (hold is not None and tuple(hold.shape) != (B,)) or amax < 1 or n < 1:
        raise ValueError(f"greedy_accept expects num_nodes and hold [{B}], amax >= 1 and n >= 1")
    if out is None:
        out = torch.empty(B, amax + 3, dtype=torch.long, device=tokens.device)
    elif tuple(out.shape) != (B, amax + 3) or out.dtype != torch.long or not out.is_contiguous():
        raise ValueError(f"greedy_accept expects out [{B}, {amax + 3}] long and contiguous")
    if B:
        greedy_accept_kernel[(B,)](
            tokens, parents, best, tokens.stride(0), parents.stride(0), best.stride(0), num_nodes.contiguous(),
            hold.contiguous() if hold is not None else num_nodes, out, AMAX=amax, HAS_HOLD=hold is not None,
            BN=max(16, triton.next_power_of_2(n)), BA=max(16, triton.next_power_of_2(amax)), num_warps=1)
    return out
