"""Right-looking serial solve of the tree GDN verify: the corrections of later blocks stay in registers.

Same inputs and outputs as `tree_gdn_solve_kernel` (verify.py), same math per block t:
    Y_t          = [beta (V_t - e^G K_t S0) ; e^G Q_t S0] - sum_{c < t} AP_t,c V'_c
    [V'_t ; O_t] = W_t Y_t
but the sum is accumulated forwards: as soon as V'_t is known, one dot subtracts AP_s,t V'_t from the
running corrections C_s of every later block s at once ([NBP*2BT, 2BT] @ [2BT, BV]; the O rows of the
[V'_t ; O_t] tile meet zero columns). C lives in registers as [NBP, 2BT, BV], so no block re-reads V'
from global memory and no barrier sits on the serial chain: per block, one select, the W dot and the
AP dot. `vnew` and `o` are only written. Fits when NBP * 2BT * BV <= RIGHT_MAX_ELEMS (NBP = NB rounded
up to a power of 2); larger trees use the left-looking solve.
"""
import triton
import triton.language as tl

from .prep import state_dot, state_split

# register budget of the corrections tile C (fp32 elements): 64 per thread at 4 warps
RIGHT_MAX_ELEMS = 8192


def right_solve_fits(NB: int, BT: int, BV: int) -> bool:
    return triton.next_power_of_2(NB) * 2 * BT * BV <= RIGHT_MAX_ELEMS


@triton.jit(do_not_specialize=["N", "H", "HV", "NB"])
def tree_gdn_solve_right_kernel(
    q, k, v, beta, state, state_idx, num_nodes, G, RN, AP, W, vnew, o, N, H, HV, K, V, NB, NPAD,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NBP: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Grid (cdiv(V, BV), B*HV). q, k: [B, N, H, K]; v, vnew, o: [B, N, HV, V]; beta, G: [B, N, HV];
    RN: [B*HV, 2, N]; AP: [B*HV, NB, 2BT, NPAD]; W: [B*HV, NB, 2BT, 2BT]; state: [P, HV, K, V]
    (or [P, HV, V, K] with STATE_V_FIRST)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_s = tl.load(state_idx + i_b).to(tl.int64)
    # a padded request (state_idx < 0) reads nothing and gets all-zero outputs
    n = tl.where(i_s >= 0, tl.load(num_nodes + i_b), 0)
    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    if STATE_V_FIRST:
        p_s = state + (i_s * HV + i_hv) * K * V + o_v[None, :] * K + o_k[:, None]
    else:
        p_s = state + (i_s * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    # [BK, BV]
    b_s = tl.load(p_s, mask=tl.where(i_s >= 0, (o_k < K)[:, None] & m_v[None, :], False),
                  other=0.).to(tl.float32)
    b_sh, b_sl = state_split(b_s, q.dtype.element_ty)
    # rows of the stacked [2BT, *] tiles: r < BT is node t BT + r of the V' (k) half, r >= BT the O half
    o_r = tl.arange(0, 2 * BT)
    m_top = o_r < BT
    # rows of the corrections: block s = R // 2BT, stacked row R % 2BT
    o_R = tl.arange(0, NBP * 2 * BT)
    s_R, r_R = o_R // (2 * BT), o_R % (2 * BT)
    o_blk = tl.arange(0, NBP)
    # [NBP, 2BT, BV] running -sum_{c < s} AP_s,c V'_c of every block s
    b_corr = tl.zeros([NBP, 2 * BT, BV], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(n, BT)):
        rows = i_t * BT + o_r % BT
        m_r = rows < n
        # [2BT, BK] rows [k_t ; q_t] (raw), [2BT] coefficients of K S0 / Q S0 and of V
        p_x = tl.where(m_top, k, q) + ((i_b * N + rows) * H + i_h) * K
        b_x = tl.load(p_x[:, None] + o_k[None, :], mask=m_r[:, None] & (o_k < K)[None, :],
                      other=0.)
        b_eG = tl.exp(tl.load(G + (i_b * N + rows) * HV + i_hv, mask=m_r, other=0.))
        b_rn = tl.load(RN + (i_bh * 2 + (o_r >= BT)) * N + rows, mask=m_r, other=0.)
        b_beta = tl.load(beta + (i_b * N + rows) * HV + i_hv, mask=m_r & m_top,
                         other=0.).to(tl.float32)
        b_v = tl.load(v + ((i_b * N + rows[:, None]) * HV + i_hv) * V + o_v[None, :],
                      mask=(m_r & m_top)[:, None] & m_v[None, :], other=0.).to(tl.float32)
        b_c = tl.where(m_top, -b_beta, 1.) * b_eG * b_rn
        p_blk = (i_bh * NB + i_t) * 2 * BT
        b_w = tl.load(W + (p_blk + o_r[:, None]) * 2 * BT + o_r[None, :])
        # [NBP*2BT, 2BT]: column block t of every later block's AP rows; the O columns are zero
        m_ap = ((s_R > i_t) & (s_R < NB))[:, None] & m_top[None, :]
        b_ap = tl.load(AP + ((i_bh * NB + s_R) * 2 * BT + r_R)[:, None] * NPAD
                       + (i_t * BT + o_r % BT)[None, :], mask=m_ap, other=0.)
        # [2BT, BV] = [beta (v - e^G rk k S0) ; e^G rq q S0] + this block's corrections
        b_y = b_beta[:, None] * b_v + b_c[:, None] * state_dot(b_x, b_sh, b_sl, DOT_PREC)
        b_y += tl.sum(tl.where((o_blk == i_t)[:, None, None], b_corr, 0.), axis=0)
        # [2BT, 2BT] @ [2BT, BV] -> [V'_t ; O_t]
        b_z = tl.dot(b_w, b_y, input_precision=DOT_PREC)
        p_out = ((i_b * N + rows[:, None]) * HV + i_hv) * V + o_v[None, :]
        m_st = (rows < N)[:, None] & m_v[None, :]
        tl.store(vnew + p_out, b_z, mask=m_st & m_top[:, None])
        tl.store(o + p_out, b_z.to(o.dtype.element_ty), mask=m_st & (o_r >= BT)[:, None])
        b_corr -= tl.reshape(tl.dot(b_ap, b_z, input_precision=DOT_PREC), (NBP, 2 * BT, BV))
    # padding blocks past n
    o_i = tl.arange(0, BT)
    for i_t in range(tl.cdiv(n, BT), tl.cdiv(N, BT)):
        rows = i_t * BT + o_i
        p_out = ((i_b * N + rows[:, None]) * HV + i_hv) * V + o_v[None, :]
        m_st = (rows < N)[:, None] & m_v[None, :]
        b_z = tl.zeros([BT, BV], dtype=tl.float32)
        tl.store(vnew + p_out, b_z, mask=m_st)
        tl.store(o + p_out, b_z.to(o.dtype.element_ty), mask=m_st)
