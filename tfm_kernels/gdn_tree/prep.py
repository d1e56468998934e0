"""Parallel first stage of the tree GDN verify: the parts of the solve that do not involve V or S0.

`tree_gdn_prep_kernel` runs, per request and value head, one program per BT-node block t for the
diagonal and one per (block t, BC-column chunk c) tile of the off-diagonal rows, all in parallel:
    diagonal program (t):
      G_t                        path-summed decay of the block's nodes             -> G  [B, N, HV]
      rk_t, rq_t                 inverse norms of k and q (rq times the scale)      -> RN [BH, 2, N]
      W_t  = [[T, 0], [P_tt T, I]] with T = (I + A_tt)^{-1}                        -> W  [BH, NB, 2BT, 2BT]
    tile program (t, c):
      AP_t,c = [A_t,c ; -P_t,c]  the off-diagonal rows of A and P over columns
                                 c BC .. c BC + BC - 1 below t BT                   -> AP [BH, NB, 2BT, NPAD]
where A_ij = beta_i D_ij k_i.k_j for j a strict ancestor of i, P_ij = D_ij q_i.k_j for j on the
path root..i, D_ij = exp(G_i - G_j), with normalised q (times the scale) and k. The Grams use the
raw q/k tiles (bf16 feeds the tensor cores as is) and are scaled by the inverse norms afterwards.
The two halves of AP and W are stacked along the rows so that the serial solve (verify.py) needs
one dot per sweep over earlier blocks and one per block.

The kernel is latency-bound, so every program issues all of its loads at once: addresses depend
only on the program ids (masked by N, not by the request's node count n, which is read alongside
and masks the values afterwards), and the ancestor words are read in an unrolled loop. Each
program's critical path is then one memory round trip plus its arithmetic, whatever the tree size.
"""
import triton
import triton.language as tl


@triton.jit
def inv_norm(x, rows, m_r, i_b, i_h, N, H, K, BK: tl.constexpr, USE_L2NORM: tl.constexpr):
    """[R] 1 / sqrt(sum x^2 + 1e-6) of rows of q or k ([B, N, H, K]); ones without l2norm.

    Reads the rows in 32-column slices (an fp32 copy of a whole [R, BK] tile costs registers).
    """
    if USE_L2NORM:
        b_ss = tl.zeros([rows.shape[0]], dtype=tl.float32)
        for i_k in tl.static_range(0, BK, 32):
            o_k = i_k + tl.arange(0, 32)
            b_x = tl.load(x + ((i_b * N + rows[:, None]) * H + i_h) * K + o_k[None, :],
                          mask=m_r[:, None] & (o_k < K)[None, :], other=0.).to(tl.float32)
            b_ss += tl.sum(b_x * b_x, 1)
        return 1. / tl.sqrt(b_ss + 1e-6)
    else:
        return tl.full([rows.shape[0]], 1., tl.float32)


@triton.jit
def gram(a, b, DOT_PREC: tl.constexpr):
    """[R, C] = a @ b^T for [R, BK] and [C, BK] tiles; 16-bit inputs feed the tensor cores as is."""
    if a.dtype == tl.float32:
        return tl.dot(a, tl.trans(b), input_precision=DOT_PREC)
    else:
        return tl.dot(a, tl.trans(b))


@triton.jit
def state_split(s, x_dtype: tl.constexpr):
    """The fp32 state tile s [BK, BV] as operands for `state_dot` with rows of dtype x_dtype.

    bf16 rows are exact in bf16, so s is split as hi + lo (both bf16): two bf16 dots then give the
    product to ~2^-16 relative, better than one tf32 dot and with half the register footprint.
    """
    if x_dtype == tl.bfloat16:
        s_hi = s.to(tl.bfloat16)
        return s_hi, (s - s_hi.to(tl.float32)).to(tl.bfloat16)
    else:
        return s, s


@triton.jit
def state_dot(x, s_hi, s_lo, DOT_PREC: tl.constexpr):
    """[R, BV] = x @ S for raw q/k rows x [R, BK] and the operands of `state_split`."""
    if x.dtype == tl.bfloat16:
        return tl.dot(x, s_hi) + tl.dot(x, s_lo)
    else:
        return tl.dot(x.to(tl.float32), s_hi, input_precision=DOT_PREC)


@triton.jit
def path_decay(g, anc, rows, m_r, i_b, i_hv, N, HV, NW: tl.constexpr, R: tl.constexpr):
    """[R] G_i = sum of g over the inclusive ancestors of node rows[i] (0 where ~m_r).

    The NW ancestor words are read in an unrolled loop, so no load waits on another.
    """
    b_G = tl.zeros([R], dtype=tl.float32)
    for i_w in tl.static_range(NW):
        o_c = i_w * 32 + tl.arange(0, 32)
        b_g = tl.load(g + (i_b * N + o_c) * HV + i_hv, mask=o_c < N, other=0.).to(tl.float32)
        b_w = tl.load(anc + (i_b * N + rows) * NW + i_w, mask=m_r, other=0)
        b_on = ((b_w[:, None] >> tl.arange(0, 32)[None, :]) & 1) != 0
        b_G += tl.sum(tl.where(b_on, b_g[None, :], 0.), 1)
    return b_G


@triton.jit
def anc_tile(anc, rows, cols, m_r, i_b, N, NW):
    """[R, C] bool: node cols[j] lies on the path root..rows[i]."""
    b_w = tl.load(anc + (i_b * N + rows[:, None]) * NW + (cols // 32)[None, :], mask=m_r[:, None],
                  other=0)
    return ((b_w >> (cols % 32)[None, :]) & 1) != 0


@triton.jit
def diag_block_inverse(b_a, BT: tl.constexpr, BASE: tl.constexpr):
    """(I + A_D)^{-1} for the BASE x BASE diagonal blocks A_D of a strictly lower [BT, BT] fp32 tile.

    Forward substitution on the transpose Y = X^T, all BASE-blocks at once: column i of each block is
    Y[:, i] = e_i - Y a_i with a_i[j] = A[i, j]. a_i is reduced out of A along its rows, so it comes
    out indexed by column, as the product with Y needs it (no layout conversion per step).
    """
    o_i = tl.arange(0, BT)
    m_same = (o_i[:, None] // BASE) == (o_i[None, :] // BASE)
    m_eye = o_i[:, None] == o_i[None, :]
    b_ad = tl.where(m_same, b_a, 0.)
    b_y = tl.where(m_eye, 1., 0.)
    for i in tl.static_range(1, BASE):
        b_ai = tl.sum(tl.where(((o_i % BASE) == i)[:, None], b_ad, 0.), 0)
        b_s = tl.sum(b_y * b_ai[None, :], 1)
        b_y = tl.where(m_same & ((o_i % BASE) == i)[None, :], tl.where(m_eye, 1., 0.) - b_s[:, None], b_y)
    return tl.trans(b_y)


@triton.jit
def merge_diag_inverses(b_xd, b_a, BT: tl.constexpr, BASE: tl.constexpr, DOT_PREC: tl.constexpr):
    """(I + A)^{-1} from the inverses X_D of its BASE x BASE diagonal blocks.

    I + A = (I + A_D)(I + N) with N = X_D L (L: A off the diagonal blocks), N^(BT/BASE) = 0, so
    (I + A)^{-1} = (I - N)(I + N^2)(I + N^4)... X_D, one factor per doubling of BASE up to BT.
    """
    if BT > BASE:
        o_i = tl.arange(0, BT)
        m_same = (o_i[:, None] // BASE) == (o_i[None, :] // BASE)
        b_n = tl.dot(b_xd, tl.where(m_same, 0., b_a), input_precision=DOT_PREC)
        b_xd = b_xd - tl.dot(b_n, b_xd, input_precision=DOT_PREC)
        if BT // BASE > 2:                                               # (I + N^2)
            b_n = tl.dot(b_n, b_n, input_precision=DOT_PREC)
            b_xd = b_xd + tl.dot(b_n, b_xd, input_precision=DOT_PREC)
        if BT // BASE > 4:                                               # (I + N^4)
            b_n = tl.dot(b_n, b_n, input_precision=DOT_PREC)
            b_xd = b_xd + tl.dot(b_n, b_xd, input_precision=DOT_PREC)
        if BT // BASE > 8:                                               # (I + N^8)
            b_n = tl.dot(b_n, b_n, input_precision=DOT_PREC)
            b_xd = b_xd + tl.dot(b_n, b_xd, input_precision=DOT_PREC)
    return b_xd


@triton.jit
def load_rows(x, rows, m_r, i_b, i_h, N, H, K, BK: tl.constexpr):
    """[R, BK] raw rows of q or k ([B, N, H, K]) for one head, zero past n or K."""
    o_k = tl.arange(0, BK)
    return tl.load(x + ((i_b * N + rows[:, None]) * H + i_h) * K + o_k[None, :],
                   mask=m_r[:, None] & (o_k < K)[None, :], other=0.)


@triton.jit
def row_terms(q, k, g, beta, anc, rows, m_r, i_b, i_h, i_hv, N, H, HV, K, scale,
              NW: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, USE_L2NORM: tl.constexpr):
    """What both program kinds need of the block's rows: raw q/k [BT, BK], G, rk, rq, beta [BT].

    `m_r` masks the loads (rows < N); the caller masks the values by the node count.
    """
    b_G = path_decay(g, anc, rows, m_r, i_b, i_hv, N, HV, NW, BT)
    b_k = load_rows(k, rows, m_r, i_b, i_h, N, H, K, BK)
    b_q = load_rows(q, rows, m_r, i_b, i_h, N, H, K, BK)
    b_rk = inv_norm(k, rows, m_r, i_b, i_h, N, H, K, BK, USE_L2NORM)
    b_rq = inv_norm(q, rows, m_r, i_b, i_h, N, H, K, BK, USE_L2NORM) * scale
    b_beta = tl.load(beta + (i_b * N + rows) * HV + i_hv, mask=m_r, other=0.).to(tl.float32)
    return b_q, b_k, b_G, b_rk, b_rq, b_beta


@triton.jit
def stashed_row_terms(G, RN, beta, rows, m_r, i_b, i_hv, i_bh, N, HV):
    """G, rk, rq (times the scale) and beta [R] of rows, read back from what the diagonal programs
    stored (zero past the node count)."""
    b_G = tl.load(G + (i_b * N + rows) * HV + i_hv, mask=m_r, other=0.)
    b_rk = tl.load(RN + i_bh * 2 * N + rows, mask=m_r, other=0.)
    b_rq = tl.load(RN + (i_bh * 2 + 1) * N + rows, mask=m_r, other=0.)
    b_beta = tl.load(beta + (i_b * N + rows) * HV + i_hv, mask=m_r, other=0.).to(tl.float32)
    return b_G, b_rk, b_rq, b_beta


@triton.jit
def off_diagonal_tile(q, k, g, beta, anc, n, G, RN, AP, scale, i_t, i_c, i_b, i_h, i_hv, i_bh,
                      rows, m_N, p_blk, N, H, HV, K, NPAD, NW: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BC: tl.constexpr, USE_L2NORM: tl.constexpr,
                      DOT_PREC: tl.constexpr, FROM_STASH: tl.constexpr, ROOT: tl.constexpr):
    """AP rows of block t over columns c BC .. c BC + BC - 1 (nodes below the block; node
    ROOT + column, see `tree_gdn_prep_kernel`).

    G and the inverse norms are derived here from g, the ancestor words and q/k, or (FROM_STASH)
    read back from G and RN, written by the diagonal programs of an earlier launch.
    """
    o_i = tl.arange(0, BT)
    o_l = i_c * BC + tl.arange(0, BC)                  # columns of AP
    m_c = o_l < i_t * BT
    o_c = ROOT + o_l                                   # their nodes
    if FROM_STASH:
        b_k = load_rows(k, rows, m_N, i_b, i_h, N, H, K, BK)
        b_q = load_rows(q, rows, m_N, i_b, i_h, N, H, K, BK)
        b_G, b_rk, b_rq, b_beta = stashed_row_terms(G, RN, beta, rows, m_N, i_b, i_hv, i_bh, N, HV)
        b_Gc, b_rkc, _, _ = stashed_row_terms(G, RN, beta, o_c, m_c, i_b, i_hv, i_bh, N, HV)
        # (read last: the program then needs fewer registers)
        b_kc = load_rows(k, o_c, m_c, i_b, i_h, N, H, K, BK)
    else:
        b_q, b_k, b_G, b_rk, b_rq, b_beta = row_terms(
            q, k, g, beta, anc, rows, m_N, i_b, i_h, i_hv, N, H, HV, K, scale, NW, BT, BK,
            USE_L2NORM)
        b_kc = load_rows(k, o_c, m_c, i_b, i_h, N, H, K, BK)
        b_rkc = inv_norm(k, o_c, m_c, i_b, i_h, N, H, K, BK, USE_L2NORM)
        b_Gc = path_decay(g, anc, o_c, m_c, i_b, i_hv, N, HV, NW, BC)
    b_on = anc_tile(anc, rows, o_c, m_N, i_b, N, NW) & m_c[None, :]
    # where (not a product) keeps non-finite padding inputs out
    b_on = b_on & (rows < n)[:, None]
    b_d = tl.exp(tl.where(b_on, b_G[:, None] - b_Gc[None, :], float('-inf')))
    b_a = tl.where(b_on, (b_beta * b_rk)[:, None] * b_d * gram(b_k, b_kc, DOT_PREC) *
                   b_rkc[None, :], 0.)
    b_p = tl.where(b_on, b_rq[:, None] * b_d * gram(b_q, b_kc, DOT_PREC) * b_rkc[None, :],
                   0.)
    p_ap = AP + (p_blk + o_i[:, None]) * NPAD + o_l[None, :]
    tl.store(p_ap, b_a, mask=m_c[None, :])
    tl.store(p_ap + BT * NPAD, -b_p, mask=m_c[None, :])


@triton.jit
def diagonal_block(q, k, g, beta, anc, n, G, RN, W, scale, i_t, i_b, i_h, i_hv,
                   i_bh, rows, m_N, p_blk, N, H, HV, K, NW: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, USE_L2NORM: tl.constexpr, DOT_PREC: tl.constexpr,
                   INV_BASE: tl.constexpr, INV_PREC: tl.constexpr):
    """G, the inverse norms and W = [[T, 0], [P_tt T, I]] of block t (T: INV_BASE-node blocks by forward
    substitution, merged with dots of precision INV_PREC)."""
    o_i = tl.arange(0, BT)
    b_q, b_k, b_G, b_rk, b_rq, b_beta = row_terms(
        q, k, g, beta, anc, rows, m_N, i_b, i_h, i_hv, N, H, HV, K, scale, NW, BT, BK,
        USE_L2NORM)
    b_on = anc_tile(anc, rows, rows, m_N, i_b, N, NW)
    m_r = rows < n
    b_on = b_on & m_r[:, None]
    b_G = tl.where(m_r, b_G, 0.)
    tl.store(G + (i_b * N + rows) * HV + i_hv, b_G, mask=m_N)
    tl.store(RN + i_bh * 2 * N + rows, tl.where(m_r, b_rk, 0.), mask=m_N)
    tl.store(RN + (i_bh * 2 + 1) * N + rows, tl.where(m_r, b_rq, 0.), mask=m_N)
    b_d = tl.exp(tl.where(b_on, b_G[:, None] - b_G[None, :], float('-inf')))
    b_a = tl.where(b_on & (o_i[:, None] > o_i[None, :]),
                   (b_beta * b_rk)[:, None] * b_d * gram(b_k, b_k, DOT_PREC) * b_rk[None, :], 0.)
    b_p = tl.where(b_on, b_rq[:, None] * b_d * gram(b_q, b_k, DOT_PREC) * b_rk[None, :], 0.)
    b_x = merge_diag_inverses(diag_block_inverse(b_a, BT, INV_BASE), b_a, BT, INV_BASE, INV_PREC)
    b_m = tl.dot(b_p, b_x, input_precision=DOT_PREC)
    p_w = W + (p_blk + o_i[:, None]) * 2 * BT + o_i[None, :]
    tl.store(p_w, b_x)
    tl.store(p_w + BT, tl.zeros([BT, BT], dtype=tl.float32))
    tl.store(p_w + 2 * BT * BT, b_m)
    tl.store(p_w + 2 * BT * BT + BT, tl.where(o_i[:, None] == o_i[None, :], 1., 0.))


# sizes that vary per call are not specialised on (one compile per 32 nodes of N serves every tree)
@triton.jit(do_not_specialize=["N", "H", "HV", "NB"])
def tree_gdn_prep_kernel(
    q, k, g, beta, anc, num_nodes, state_idx, G, RN, AP, W, scale, N, H, HV, K, NB, NPAD,
    NW: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
    USE_L2NORM: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr, PART: tl.constexpr,
    ROOT: tl.constexpr, INV_BASE: tl.constexpr, INV_PREC: tl.constexpr,
):
    """ROOT = 1 (`tree_gdn_verify(single_root=True)`): node 0 is every node's ancestor and the solve
    folds it into the state, so the blocks cover nodes 1 .. N-1 (block t: nodes 1 + t BT ..) and the
    diagonal program of block 0 also stores G of node 0 (= g_0, for the commit)."""
    if PDL:
        # this launch may start before the kernel before it has finished: wait for it (and its
        # writes, e.g. q/k/v) before any load. Only then let the next launch be scheduled: the solve
        # reads q/k/v and S0 before its own gdc_wait, which covers its predecessor's outputs only.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # programs 0 .. NB-1 are the diagonal blocks, the NT others the off-diagonal tiles (block t
    # has cdiv(t BT, BC) of them), so no program is empty. PART 0: all in one grid (NB + NT,
    # B * HV); PART 1: the diagonal programs alone (NB, B * HV); PART 2: the tiles alone
    # (NT, B * HV), reading G and the norms that a PART 1 launch stored.
    i_p, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    if PART == 2:
        i_p += NB
    i_t, i_c, r = i_p, 0, i_p - NB
    for s in range(1, NB):
        cnt = tl.cdiv(s * BT, BC)
        hit = (r >= 0) & (r < cnt)
        i_t = tl.where(hit, s, i_t)
        i_c = tl.where(hit, r, i_c)
        r -= cnt
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    rows = ROOT + i_t * BT + tl.arange(0, BT)
    m_N = rows < N
    # read alongside the other loads (no address depends on it); a padded request
    # (state_idx < 0) counts no nodes
    i_s = tl.load(state_idx + i_b)
    n = tl.where(i_s >= 0, tl.load(num_nodes + i_b), 0)
    p_blk = (i_bh * NB + i_t) * 2 * BT
    if PART == 2 or (PART == 0 and i_p >= NB):
        off_diagonal_tile(q, k, g, beta, anc, n, G, RN, AP, scale, i_t, i_c, i_b, i_h, i_hv, i_bh,
                          rows, m_N, p_blk, N, H, HV, K, NPAD, NW, BT, BK, BC, USE_L2NORM,
                          DOT_PREC, PART == 2, ROOT)
    else:
        diagonal_block(q, k, g, beta, anc, n, G, RN, W, scale, i_t, i_b, i_h,
                       i_hv, i_bh, rows, m_N, p_blk, N, H, HV, K, NW, BT, BK, USE_L2NORM, DOT_PREC,
                       INV_BASE, INV_PREC)
        if ROOT:
            b_g0 = tl.load(g + i_b * N * HV + i_hv).to(tl.float32)
            tl.store(G + i_b * N * HV + i_hv, tl.where(n > 0, b_g0, 0.), mask=i_t == 0)
