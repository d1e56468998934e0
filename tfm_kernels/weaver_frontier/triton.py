"""The frontier steps of the shape-static Weaver tree build, each in one launch (Triton): `place` one program per
tree, `push` one per expanded slot. The build runs both once per round, in sixteen or more sequential rounds, where
launches are most of the time.

`place` does what `ref.place_ref` does in a sort and about twenty-five torch launches: rank the frontier (each
entry's rank in a stable sort of the scores, descending, counted: the entries that go before it), read the `width`
best entries, write them to their placement slots, count the placed ones, keep the next `budget` entries at the
head of the frontier, write the new slots' attention rows (ancestors and itself) and the step's token, depth, score
and active flags. `push` does what `ref.push_ref` does in a sort and about twelve: pick each slot's top-E candidates
by log q, write them into the frontier as children (parent, token, depth, log q, and score = the parent's score +
log q in f64, -inf where invalid) and mark the rows after them invalid. `finish` (one program per tree) writes the
trees' node rows, node counts and `truncated` flags from the placement slots, where `ref.finish_ref` takes about
twenty launches. They only move and compare values, and add two f64 values as the reference does: they equal it
exactly.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def weaver_place_kernel(front_int, front_flt, perm, slot_int, slot_flt, slot_placed, count, visible, vis_sb, vis_sr,
                        tok, dep, score, active, row, s0, M, P, S, W, N, LOOKAHEAD, EXPAND, ROWS_PER_TREE,
                        BW: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr, BJ: tl.constexpr):
    """Tree `program_id(0)`: shapes as `place` (row-major buffers but `visible`: strides vis_sb, vis_sr, 1; bool as
    int8)."""
    b = tl.program_id(0).to(tl.int64)
    o_w, o_n, o_s = tl.arange(0, BW), tl.arange(0, BN), tl.arange(0, BS)
    m_w, m_n = o_w < W, o_n < N
    # rank: entry i goes after every higher score and every equal score of an earlier entry (a stable sort)
    o_m = tl.arange(0, BM)
    m_m = o_m < M
    s_i = tl.load(front_flt + (b * M + o_m) * 2, mask=m_m, other=float("-inf"))                # [BM]
    rank = tl.zeros([BM], dtype=tl.int32)
    for j0 in range(0, M, BJ):
        o_j = j0 + tl.arange(0, BJ)
        s_j = tl.load(front_flt + (b * M + o_j) * 2, mask=o_j < M, other=float("-inf"))       # [BJ]
        ahead = (s_j[None, :] > s_i[:, None]) | ((s_j[None, :] == s_i[:, None]) & (o_j[None, :] < o_m[:, None]))
        rank += tl.sum((ahead & (o_j < M)[None, :]).to(tl.int32), axis=1)
    tl.store(perm + b * M + rank, o_m.to(tl.int64), mask=m_m)                                 # perm[rank] = entry
    tl.debug_barrier()                                # perm written by other threads: read it from L2 (.cg)
    # every read first: the keep below overwrites frontier rows that the slots read
    e = tl.load(perm + b * M + o_w, mask=m_w, other=0, cache_modifier=".cg")                 # [BW]
    par = tl.load(front_int + (b * M + e) * 3, mask=m_w, other=0)
    tk = tl.load(front_int + (b * M + e) * 3 + 1, mask=m_w, other=0)
    dp = tl.load(front_int + (b * M + e) * 3 + 2, mask=m_w, other=0)
    sc = tl.load(front_flt + (b * M + e) * 2, mask=m_w, other=float("-inf"))
    lq = tl.load(front_flt + (b * M + e) * 2 + 1, mask=m_w, other=0.)
    k = tl.load(perm + b * M + W + o_n, mask=m_n, other=0, cache_modifier=".cg")             # [BN]
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
    rows = tl.load(visible + b * vis_sb + pc[:, None] * vis_sr + o_s[None, :], mask=m_rows & (pc < S)[:, None],
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
        rows = ((rows | (o_s[None, :] == pc[:, None])) & act[:, None]) | (o_s[None, :] == (s0 + o_w)[:, None])
        tl.store(visible + b * vis_sb + (s0 + o_w[:, None]) * vis_sr + o_s[None, :], rows.to(tl.int8), mask=m_rows)
    tl.store(tok + b * W + o_w, tl.where(act, tk, 0), mask=m_w)
    tl.store(dep + b * W + o_w, tl.where(act, dp, 0), mask=m_w)
    tl.store(score + b * W + o_w, sc, mask=m_w)
    tl.store(active + b * W + o_w, act.to(tl.int8), mask=m_w)
    tl.store(row + b * W + o_w, b * ROWS_PER_TREE + tl.where(act, dp, 0), mask=m_w)


def place(front_int, front_flt, perm, slot_int, slot_flt, slot_placed, count, visible, out, s0: int, budget: int,
          lookahead: int, expand: bool, rows_per_tree: int) -> None:
    """`ref.place_ref` in one launch (arguments and shapes as there; every tensor contiguous, on one device, but
    `visible` may be a view with rows apart: its last dim contiguous)."""
    tok, dep, score, active, row = out
    B, W = tok.shape
    M, P, S = front_int.shape[1], slot_int.shape[1], visible.shape[-1]
    ts = (front_int, front_flt, perm, slot_int, slot_flt, slot_placed, count, tok, dep, score, active, row)
    if (not all(t.is_contiguous() and t.device == tok.device for t in ts) or W + budget > M or s0 + W > P
            or (expand and s0 + W > S) or visible.stride(-1) != 1 or visible.device != tok.device):
        raise ValueError("place expects contiguous buffers on one device (visible: its last dim), width + budget <= "
                         f"M, s0 + width <= P and, to expand, <= S; got width {W}, budget {budget}, M {M}, s0 {s0}, "
                         f"P {P}, S {S}")
    as_i8 = [t.view(torch.int8) for t in (slot_placed, visible, active)]
    weaver_place_kernel[(B,)](front_int, front_flt, perm, slot_int, slot_flt, as_i8[0], count, as_i8[1],
                              visible.stride(0), visible.stride(1), tok, dep, score, as_i8[2], row, s0, M, P, S, W,
                              budget, lookahead, int(expand), rows_per_tree,
                              BW=triton.next_power_of_2(W), BN=triton.next_power_of_2(budget),
                              BS=triton.next_power_of_2(S), BM=triton.next_power_of_2(M),
                              BJ=min(32, triton.next_power_of_2(M)), num_warps=4)


@triton.jit
def weaver_push_kernel(front_int, front_flt, logq, cand_ids, rows, dep, active, score, s0, M, N, W, E, K,
                       BK: tl.constexpr, BF: tl.constexpr):
    """Slot `program_id(1)` of tree `program_id(0)`: shapes as `push` (row-major; bool as int8). Its E children are
    picked one at a time: the largest log q left (NaN as +inf, the place torch's sort gives it), the earliest
    candidate among equal ones. Slot 0's program also marks the rows after all slots' children invalid."""
    b, w = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    v = tl.load(logq + (b * W + w) * K + o_k, mask=m_k, other=0.)                               # [BK]
    key = tl.where(m_k, tl.where(v != v, float("inf"), v), float("-inf"))
    taken = ~m_k
    r = tl.load(rows + b * W + w)
    dp = tl.load(dep + b * W + w)
    act = tl.load(active + b * W + w) != 0
    sc = tl.load(score + b * W + w)
    for j in range(E):
        mx = tl.max(tl.where(taken, float("-inf"), key), axis=0)
        c = tl.min(tl.where((key == mx) & ~taken, o_k, BK), axis=0)                             # the child's column
        hit = o_k == c
        lq = tl.sum(tl.where(hit, v, 0.), axis=0).to(tl.float64)
        tk = tl.load(cand_ids + r * K + c)
        taken = taken | hit
        row = b * M + N + w * E + j
        tl.store(front_int + row * 3, s0 + w)
        tl.store(front_int + row * 3 + 1, tk)
        tl.store(front_int + row * 3 + 2, dp + 1)
        tl.store(front_flt + row * 2, tl.where(act & (lq > float("-inf")), sc + lq, float("-inf")))
        tl.store(front_flt + row * 2 + 1, lq)
    if w == 0:
        rest = N + W * E + tl.arange(0, BF)                                                    # the rows after them
        tl.store(front_flt + (b * M + rest) * 2, tl.full([BF], float("-inf"), tl.float64), mask=rest < M)


def push(front_int, front_flt, logq, cand_ids, rows, dep, active, score, s0: int, budget: int, expand: int) -> None:
    """`ref.push_ref` in one launch, the top-E choice included (arguments and shapes as there; every tensor
    contiguous, on one device)."""
    B, W, K = logq.shape
    M = front_int.shape[1]
    ts = (front_int, front_flt, logq, cand_ids, rows, dep, active, score)
    if (not all(t.is_contiguous() and t.device == logq.device for t in ts) or budget + W * expand > M
            or not 1 <= expand <= K or cand_ids.shape[-1] != K):
        raise ValueError(f"push expects contiguous buffers on one device, 1 <= expand <= K, a candidate table "
                         f"[R, {K}] and budget + W * expand <= M; got budget {budget}, W {W}, expand {expand}, "
                         f"K {K}, M {M}")
    weaver_push_kernel[(B, W)](front_int, front_flt, logq, cand_ids, rows, dep, active.view(torch.int8), score, s0,
                               M, budget, W, expand, K, BK=triton.next_power_of_2(K),
                               BF=triton.next_power_of_2(max(M - budget, 1)), num_warps=2)


@triton.jit
def weaver_finish_kernel(slot_int, slot_flt, slot_placed, front_flt, last_active, tokens, parents, depths, logprobs,
                         num_nodes, truncated, P, M, N, W, HAS_LAST: tl.constexpr, BP: tl.constexpr,
                         BJ: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr):
    """Tree `program_id(0)`: shapes as `finish` (row-major; bool as int8; node rows N + 2 wide). A placed slot's
    node id is the count of placed slots up to it; its parent's, looked up BJ slots at a time."""
    b = tl.program_id(0).to(tl.int64)
    o_p = tl.arange(0, BP)
    m_p = o_p < P
    placed = (tl.load(slot_placed + b * P + o_p, mask=m_p, other=0) != 0) & m_p                # [BP]
    node = (tl.cumsum(placed.to(tl.int32), axis=0) - 1).to(tl.int64)                           # [BP]
    count = tl.sum(placed.to(tl.int64), axis=0)
    ps = tl.load(slot_int + (b * P + o_p) * 3, mask=placed, other=-1)                         # parent slot
    tok = tl.load(slot_int + (b * P + o_p) * 3 + 1, mask=placed, other=0)
    dep = tl.load(slot_int + (b * P + o_p) * 3 + 2, mask=placed, other=0)
    lq = tl.load(slot_flt + (b * P + o_p) * 2 + 1, mask=placed, other=0.)
    pn = tl.full([BP], -1, tl.int64)                                                           # parent node
    run = tl.zeros([], dtype=tl.int64)                                                         # placed before j0
    for j0 in range(0, P, BJ):
        o_j = j0 + tl.arange(0, BJ)
        pj = (tl.load(slot_placed + b * P + o_j, mask=o_j < P, other=0) != 0) & (o_j < P)      # [BJ]
        nj = run + tl.cumsum(pj.to(tl.int32), axis=0).to(tl.int64) - 1                         # [BJ] node ids
        hit = ps[:, None] == o_j[None, :]                                                      # [BP, BJ]
        pn = tl.where(tl.sum(hit.to(tl.int32), axis=1) > 0, tl.sum(tl.where(hit, nj[None, :], 0), axis=1), pn)
        run += tl.sum(pj.to(tl.int64), axis=0)
    row = b * (N + 2)
    tl.store(tokens + row + node, tok, mask=placed)
    tl.store(parents + row + node, pn, mask=placed)
    tl.store(depths + row + node, dep, mask=placed)
    tl.store(logprobs + row + node, lq, mask=placed)
    o_c = tl.arange(0, BC)
    rest = (o_c >= count) & (o_c <= N)                                                         # columns past the tree
    tl.store(tokens + row + o_c, tl.zeros([BC], dtype=tl.int64), mask=rest)
    tl.store(parents + row + o_c, tl.full([BC], -1, tl.int64), mask=rest)
    tl.store(depths + row + o_c, tl.zeros([BC], dtype=tl.int64), mask=rest)
    tl.store(logprobs + row + o_c, tl.zeros([BC], dtype=tl.float64), mask=rest)
    o_m = tl.arange(0, BM)
    sc = tl.load(front_flt + (b * M + o_m) * 2, mask=o_m < (N if HAS_LAST else M), other=float("-inf"))
    left = tl.sum((sc > float("-inf")).to(tl.int32), axis=0) > 0
    if HAS_LAST:
        o_w = tl.arange(0, BW)
        act = tl.load(last_active + b * W + o_w, mask=o_w < W, other=0)
        left = left | (tl.sum((act != 0).to(tl.int32), axis=0) > 0)
    tl.store(num_nodes + b, count)
    tl.store(truncated + b, ((count < N + 1) & left).to(tl.int8))


def finish(slot_int, slot_flt, slot_placed, front_flt, last_active, out, budget: int) -> None:
    """`ref.finish_ref` in one launch (arguments and shapes as there; every tensor contiguous, on one device). Column
    N+1 of the node rows is not written."""
    tokens, parents, depths, logprobs, num_nodes, truncated = out
    B, P = slot_placed.shape
    M, N = front_flt.shape[1], budget
    W = 1 if last_active is None else last_active.shape[1]
    ts = (slot_int, slot_flt, slot_placed, front_flt, *out) + (() if last_active is None else (last_active,))
    if (not all(t.is_contiguous() and t.device == tokens.device for t in ts) or tokens.shape != (B, N + 2)
            or N > M):
        raise ValueError(f"finish expects contiguous buffers on one device, node rows [{B}, {N + 2}] and budget <= "
                         f"M; got node rows {list(tokens.shape)}, budget {N}, M {M}")
    act = slot_placed if last_active is None else last_active
    weaver_finish_kernel[(B,)](slot_int, slot_flt, slot_placed.view(torch.int8), front_flt, act.view(torch.int8),
                               tokens, parents, depths, logprobs, num_nodes, truncated.view(torch.int8), P, M, N, W,
                               HAS_LAST=last_active is not None, BP=triton.next_power_of_2(P),
                               BJ=min(32, triton.next_power_of_2(P)), BC=triton.next_power_of_2(N + 1),
                               BM=triton.next_power_of_2(M), BW=triton.next_power_of_2(W), num_warps=4)
