"""Commit the accepted path of a verified tree into the recurrent-state pool.

S_new = e^{G_leaf} S0 + K_path^T diag(e^{G_leaf - G_path}) V'_path: one read and one write of the
state per (request, value head), plus a [K x BC] @ [BC x BV] dot per BC-node block of the path.
"""
import triton
import triton.language as tl

from .verify import GDNTreeStash


@triton.jit
def load_qk_block(x, rows, m_rows, i_b, i_h, o_k, m_k, N: tl.constexpr, H: tl.constexpr,
                  K: tl.constexpr, USE_L2NORM: tl.constexpr):
    # [BC, BK] rows of q or k for one head, fp32, L2-normalised if asked
    b_x = tl.load(x + ((i_b * N + rows[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_rows[:, None] & m_k[None, :], other=0.).to(tl.float32)
    if USE_L2NORM:
        b_x = b_x / tl.sqrt(tl.sum(b_x * b_x, 1) + 1e-6)[:, None]
    return b_x


@triton.jit
def tree_gdn_commit_kernel(
    k, vnew, G, anc, leaf, state, state_idx, out_idx,
    N: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    NW: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, STATE_V_FIRST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = (i_bh // HV).to(tl.int64), i_bh % HV
    i_h = i_hv // (HV // H)
    i_s = tl.load(state_idx + i_b).to(tl.int64)
    i_o = tl.load(out_idx + i_b).to(tl.int64)
    i_l = tl.load(leaf + i_b).to(tl.int64)
    if (i_s >= 0) & (i_o >= 0):
        o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
        m_s = (o_k < K)[:, None] & (o_v < V)[None, :]
        if STATE_V_FIRST:
            o_s = o_v[None, :] * K + o_k[:, None]
        else:
            o_s = o_k[:, None] * V + o_v[None, :]
        # [BK, BV]
        b_s = tl.load(state + (i_s * HV + i_hv) * K * V + o_s, mask=m_s, other=0.).to(tl.float32)
        if i_l >= 0:
            b_Gl = tl.load(G + (i_b * N + i_l) * HV + i_hv)
            b_s = b_s * tl.exp(b_Gl)
            for i_c in range(0, i_l // BC + 1):
                o_c = i_c * BC + tl.arange(0, BC)
                m_c = o_c <= i_l
                # [BC] which nodes of this block lie on the path root..leaf; the other loads do
                # not wait for it (weights are zero off the path)
                b_on = ((tl.load(anc + (i_b * N + i_l) * NW + o_c // 32, mask=m_c, other=0)
                         >> (o_c % 32)) & 1) != 0
                b_Gc = tl.load(G + (i_b * N + o_c) * HV + i_hv, mask=m_c, other=0.)
                b_kc = load_qk_block(k, o_c, m_c, i_b, i_h, o_k, o_k < K, N, H, K, USE_L2NORM)
                # [BC, BV]
                b_u = tl.load(vnew + ((i_b * N + o_c[:, None]) * HV + i_hv) * V + o_v[None, :],
                              mask=m_c[:, None] & (o_v < V)[None, :], other=0.)
                b_w = tl.exp(tl.where(b_on, b_Gl - b_Gc, float('-inf')))
                b_s += tl.dot(tl.trans(b_kc), b_u * b_w[:, None], input_precision=DOT_PREC)
        tl.store(state + (i_o * HV + i_hv) * K * V + o_s, b_s.to(state.dtype.element_ty), mask=m_s)


def tree_gdn_commit(state_pool, state_idx, leaf, stash: GDNTreeStash, out_idx=None,
                    precision="tf32"):
    r"""Write the state after the accepted path root..leaf[b] into `state_pool[out_idx[b]]`.

    Args:
        state_pool: [P, HV, K, V] (or [P, HV, V, K], as in the verify) fp32/bf16: the pool, still
            unchanged, that `tree_gdn_verify` read.
        state_idx: [B] int32 slots the verify read; -1 = padded request (nothing written).
        leaf: [B] int accepted leaf per request; -1 = nothing accepted (S0 is copied to out_idx).
        stash: the `GDNTreeStash` returned by `tree_gdn_verify`.
        out_idx: [B] int32 destination slots. Default: `state_idx` (in place). A different slot
            leaves the source untouched (double buffering, prefix-cache snapshots).
        precision: `tl.dot` input precision on GPU, "tf32" | "tf32x3" | "ieee".
    Returns:
        state_pool (written in place).
    """
    k, vnew, G, anc, l2, v_first = stash
    B, N, H, K = k.shape
    HV, V = vnew.shape[2], vnew.shape[3]
    want = (HV, V, K) if v_first else (HV, K, V)
    if tuple(state_pool.shape[1:]) != want:
        raise ValueError(f"expected state_pool [P, {', '.join(map(str, want))}] (the verify's "
                         f"layout), got {tuple(state_pool.shape)}")
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous (it is indexed by slot, head and layout)")
    out_idx = state_idx if out_idx is None else out_idx
    # path nodes per dot and V columns per program
    BC = min(64, max(16, triton.next_power_of_2(N)))
    BV = min(32, max(16, triton.next_power_of_2(V)))
    grid = (triton.cdiv(V, BV), B * HV)
    tree_gdn_commit_kernel[grid](
        k, vnew, G, anc, leaf.contiguous(), state_pool, state_idx.contiguous(),
        out_idx.contiguous(), N=N, H=H, HV=HV, K=K, V=V, NW=anc.shape[-1], BC=BC,
        BK=max(16, triton.next_power_of_2(K)), BV=BV, USE_L2NORM=l2, STATE_V_FIRST=v_first,
        DOT_PREC=precision, num_warps=4)
    return state_pool
