"""The placement step of the shape-static Weaver tree build in one launch (Triton): one program per tree.

It does what `ref.py` does in about twenty-five torch launches: read the `width` best frontier entries (their order
comes from a stable sort), write them to their placement slots, count the placed ones, keep the next `budget`
entries at the head of the frontier, write the new slots' ancestor rows and the step's token, depth, score and
active flags. The build runs this once per round, in sixteen or more sequential rounds, where launches are most of
the time. Every value is moved or compared, never computed in floating point: the result equals the reference's.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def weaver_place_kernel(front_int, front_flt, perm, slot_int, slot_flt, slot_placed, count, visible,
                        tok, dep, score, active, s0, M, P, S, W, N, LOOKAHEAD, EXPAND,
                        BW: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr):
    """Tree `program_id(0)`: shapes as `place` (row-major buffers, bool as int8)."""
    b = tl.program_id(0).to(tl.int64)
    o_w, o_n, o_s = tl.arange(0, BW), tl.arange(0, BN), tl.arange(0, BS)
    m_w, m_n = o_w < W, o_n < N
    # every read first: the keep below overwrites frontier rows that the slots read
    e = tl.load(perm + b * M + o_w, mask=m_w, other=0)                                       # [BW]
    par = tl.load(front_int + (b * M + e) * 3, mask=m_w, other=0)
    tk = tl.load(front_int + (b * M + e) * 3 + 1, mask=m_w, other=0)
    dp = tl.load(front_int + (b * M + e) * 3 + 2, mask=m_w, other=0)
    sc = tl.load(front_flt + (b * M + e) * 2, mask=m_w, other=float("-inf"))
    lq = tl.load(front_flt + (b * M + e) * 2 + 1, mask=m_w, other=0.)
    k = tl.load(perm + b * M + W + o_n, mask=m_n, other=0)                                   # [BN]
    k_par = tl.load(front_int + (b * M + k) * 3, mask=m_n, other=0)
    k_tok = tl.load(front_int + (b * M + k) * 3 + 1, mask=m_n, other=0)
    k_dep = tl.load(front_int + (b * M + k) * 3 + 2, mask=m_n, other=0)
    k_sc = tl.load(front_flt + (b * M + k) * 2, mask=m_n, other=0.)
    k_lq = tl.load(front_flt + (b * M + k) * 2 + 1, mask=m_n, other=0.)
    cnt = tl.load(count + b)
    placed = (sc > float("-inf")) & (o_w < N + 1 - cnt) & m_w                               # [BW]
    act = placed & (dp < LOOKAHEAD)
    pc = tl.maximum(par, 0)
    m_rows = m_w[:, None] & (o_s < S)[None, :]
    rows = tl.load(visible + (b * S + pc[:, None]) * S + o_s[None, :], mask=m_rows & (pc < S)[:, None],
                   other=0) != 0                                                              # [BW, BS]
    tl.debug_barrier()
    # then every write
    p_slot = b * P + s0 + o_w
    tl.store(slot_int + p_slot * 3, par, mask=m_w)
    tl.store(slot_int + p_slot * 3 + 1, tk, mask=m_w)
    tl.store(slot_int + p_slot * 3 + 2, dp, mask=m_w)
    tl.store(slot_flt + p_slot * 2, sc, mask=m_w)
    tl.store(slot_flt + p_slot * 2 + 1, lq, mask=m_w)
    tl.store(slot_placed + p_slot, placed.to(tl.int8), mask=m_w)
    tl.store(count + b, cnt + tl.sum(placed.to(tl.int64), axis=0))
    tl.store(front_int + (b * M + o_n) * 3, k_par, mask=m_n)
    tl.store(front_int + (b * M + o_n) * 3 + 1, k_tok, mask=m_n)
    tl.store(front_int + (b * M + o_n) * 3 + 2, k_dep, mask=m_n)
    tl.store(front_flt + (b * M + o_n) * 2, k_sc, mask=m_n)
    tl.store(front_flt + (b * M + o_n) * 2 + 1, k_lq, mask=m_n)
    if EXPAND:
        rows = (rows | (o_s[None, :] == pc[:, None])) & act[:, None]
        tl.store(visible + (b * S + s0 + o_w[:, None]) * S + o_s[None, :], rows.to(tl.int8), mask=m_rows)
    tl.store(tok + b * W + o_w, tl.where(act, tk, 0), mask=m_w)
    tl.store(dep + b * W + o_w, tl.where(act, dp, 0), mask=m_w)
    tl.store(score + b * W + o_w, sc, mask=m_w)
    tl.store(active + b * W + o_w, act.to(tl.int8), mask=m_w)


def place(front_int, front_flt, perm, slot_int, slot_flt, slot_placed, count, visible, out, s0: int, budget: int,
          lookahead: int, expand: bool) -> None:
    """`ref.place_ref` in one launch (arguments and shapes as there; every tensor contiguous, on one device)."""
    tok, dep, score, active = out
    B, W = tok.shape
    M, P, S = front_int.shape[1], slot_int.shape[1], visible.shape[-1]
    ts = (front_int, front_flt, perm, slot_int, slot_flt, slot_placed, count, visible, tok, dep, score, active)
    if (not all(t.is_contiguous() and t.device == tok.device for t in ts) or W + budget > M or s0 + W > P
            or (expand and s0 + W > S)):
        raise ValueError("place expects contiguous buffers on one device, width + budget <= M, s0 + width <= P and, "
                         f"to expand, <= S; got width {W}, budget {budget}, M {M}, s0 {s0}, P {P}, S {S}")
    as_i8 = [t.view(torch.int8) for t in (slot_placed, visible, active)]
    weaver_place_kernel[(B,)](front_int, front_flt, perm, slot_int, slot_flt, as_i8[0], count, as_i8[1],
                              tok, dep, score, as_i8[2], s0, M, P, S, W, budget, lookahead, int(expand),
                              BW=triton.next_power_of_2(W), BN=triton.next_power_of_2(budget),
                              BS=triton.next_power_of_2(S), num_warps=4)
