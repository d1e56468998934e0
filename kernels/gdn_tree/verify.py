"""Tree-masked Gated DeltaNet verify: outputs for every node, the committed state read-only.

Two launches. `tree_gdn_prep_kernel` (one program per request, value head and 16-node block)
computes the path-summed decay G and the inverses (I + A_bb)^{-1} of the 16x16 diagonal
blocks, all in parallel. `tree_gdn_fwd_kernel` (one program per V-tile, request and value head)
then runs block forward substitution (left-looking) over blocks of BT rows: for block t,
    R_t  = beta (V_t - e^{G_t} K_t S0) - sum_{c<t} A_tc V'_c
    V'_t = (I + A_tt)^{-1} R_t
    O_t  = e^{G_t} Q_t S0 + sum_{c<=t} (D_tc * Q_t K_c^T) V'_c
where A and D carry the ancestor mask and the path-summed decay (see ref.py). V'_c of earlier
blocks is re-read from the `vnew` stash this program wrote; (I + A_tt)^{-1} is merged from the
16x16 inverses with a block-Neumann product.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .tree import MAX_NODES, tree_ancestor_bits


class GDNTreeStash(NamedTuple):
    """What `tree_gdn_commit` needs from a verify: raw keys, corrected values, path decay, tree."""
    k: torch.Tensor      # [B, N, H, K] (the verify input, not a copy)
    vnew: torch.Tensor   # [B, N, HV, V] fp32
    G: torch.Tensor      # [B, N, HV] fp32
    anc: torch.Tensor    # [B, N, ceil(N/32)] int32
    use_qk_l2norm: bool
    state_v_first: bool


@triton.jit
def unit_lower_inverse(b_a, n_rows, BT: tl.constexpr):
    """(I + A)^{-1} of every 16x16 diagonal block of a strictly lower [BT, BT] fp32 tile.

    The result is block diagonal; rows >= n_rows are left as identity.
    """
    o_i = tl.arange(0, BT)
    m_same = (o_i[:, None] // 16) == (o_i[None, :] // 16)
    m_eye = o_i[:, None] == o_i[None, :]
    b_ad = tl.where(m_same, b_a, 0.)
    b_x = tl.where(m_eye, 1., 0.)
    # forward substitution X = I - A X inside every block at once: row i of a block only needs
    # rows < i of the same block, so each step is two reductions
    for i in range(0, tl.minimum(n_rows, 16)):
        m_row = (o_i % 16) == i
        # [BT]: entry c holds A[row i of block(c), c]
        b_ai = tl.sum(tl.where(m_row[:, None], b_ad, 0.), 0)
        # [BT]: entry c holds (A X)[row i of block(c), c]; X is block diagonal
        b_s = tl.sum(b_ai[:, None] * b_x, 0)
        b_x = tl.where(m_row[:, None] & m_same, tl.where(m_eye, 1., 0.) - b_s[None, :], b_x)
    return b_x


@triton.jit
def merge_diag_inverses(b_xd, b_a, BT: tl.constexpr, DOT_PREC: tl.constexpr):
    """(I + A)^{-1} from the inverses X_D of its 16x16 diagonal blocks (BT in 16, 32, 64).

    I + A = (I + D)(I + N) with N = X_D L (L: A off the diagonal blocks), N^(BT/16) = 0, so
    (I + A)^{-1} = (I - N)(I + N^2) X_D.
    """
    if BT > 16:
        o_i = tl.arange(0, BT)
        m_same = (o_i[:, None] // 16) == (o_i[None, :] // 16)
        b_n = tl.dot(b_xd, tl.where(m_same, 0., b_a), input_precision=DOT_PREC)
        b_xd = b_xd - tl.dot(b_n, b_xd, input_precision=DOT_PREC)
        if BT > 32:
            b_n2 = tl.dot(b_n, b_n, input_precision=DOT_PREC)
            b_xd = b_xd + tl.dot(b_n2, b_xd, input_precision=DOT_PREC)
    return b_xd


@triton.jit
def load_qk_block(x, rows, m_rows, i_b, i_h, o_k, m_k, N: tl.constexpr, H: tl.constexpr,
                  K: tl.constexpr, USE_L2NORM: tl.constexpr):
    # [BT, BK] rows of q or k for one head, fp32, L2-normalised if asked
    b_x = tl.load(x + ((i_b * N + rows[:, None]) * H + i_h) * K + o_k[None, :],
                  mask=m_rows[:, None] & m_k[None, :], other=0.).to(tl.float32)
    if USE_L2NORM:
        b_x = b_x / tl.sqrt(tl.sum(b_x * b_x, 1) + 1e-6)[:, None]
    return b_x


@triton.jit
def tree_gdn_prep_kernel(k, g, beta, anc, num_nodes, state_idx, G, dinv,
                         N: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                         NW: tl.constexpr, N16: tl.constexpr, BK: tl.constexpr,
                         USE_L2NORM: tl.constexpr, DOT_PREC: tl.constexpr):
    # one program per 16-node block: path-summed decay G and (I + A_bb)^{-1} of the diagonal block
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = (i_bh // HV).to(tl.int64), i_bh % HV
    i_h = i_hv // (HV // H)
    i_s = tl.load(state_idx + i_b)
    n = tl.where(i_s >= 0, tl.load(num_nodes + i_b), 0)
    o_i = tl.arange(0, 16)
    o_t = i_t * 16 + o_i
    m_t = o_t < n
    # G_i = sum_j bit(i, j) g_j over the words up to this block
    b_G = tl.zeros([16], dtype=tl.float32)
    for i_w in range(0, tl.cdiv(tl.minimum(n, i_t * 16 + 16), 32)):
        o_c = i_w * 32 + tl.arange(0, 32)
        b_g = tl.load(g + (i_b * N + o_c) * HV + i_hv, mask=o_c < n, other=0.).to(tl.float32)
        b_w = tl.load(anc + (i_b * N + o_t) * NW + i_w, mask=m_t, other=0)
        b_on = ((b_w[:, None] >> tl.arange(0, 32)[None, :]) & 1) != 0
        b_G += tl.sum(tl.where(b_on, b_g[None, :], 0.), 1)
    tl.store(G + (i_b * N + o_t) * HV + i_hv, b_G, mask=o_t < N)
    if i_t * 16 < n:
        o_k = tl.arange(0, BK)
        b_k = load_qk_block(k, o_t, m_t, i_b, i_h, o_k, o_k < K, N, H, K, USE_L2NORM)
        b_beta = tl.load(beta + (i_b * N + o_t) * HV + i_hv, mask=m_t, other=0.).to(tl.float32)
        b_on = ((tl.load(anc + (i_b * N + o_t[:, None]) * NW + (o_t // 32)[None, :],
                         mask=m_t[:, None], other=0) >> (o_t % 32)[None, :]) & 1) != 0
        b_on = b_on & (o_i[:, None] > o_i[None, :])
        b_d = tl.exp(tl.where(b_on, b_G[:, None] - b_G[None, :], float('-inf')))
        b_a = b_beta[:, None] * b_d * tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
        b_x = unit_lower_inverse(b_a, n - i_t * 16, 16)
        tl.store(dinv + (i_bh * N16 + o_t[:, None]) * 16 + o_i[None, :], b_x)


@triton.jit
def tree_gdn_fwd_kernel(
    q, k, v, beta, anc, num_nodes, state, state_idx, o, vnew, G, dinv, scale,
    N: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    NW: tl.constexpr, N16: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, STATE_V_FIRST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = (i_bh // HV).to(tl.int64), i_bh % HV
    i_h = i_hv // (HV // H)
    i_s = tl.load(state_idx + i_b).to(tl.int64)
    # a padded request (state_idx < 0) reads nothing and gets all-zero outputs
    n = tl.where(i_s >= 0, tl.load(num_nodes + i_b), 0)

    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    if STATE_V_FIRST:
        p_s = state + (i_s * HV + i_hv) * K * V + o_v[None, :] * K + o_k[:, None]
    else:
        p_s = state + (i_s * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    # [BK, BV]
    b_s = tl.load(p_s, mask=tl.where(i_s >= 0, m_k[:, None] & m_v[None, :], False),
                  other=0.).to(tl.float32)

    o_i = tl.arange(0, BT)
    m_same = (o_i[:, None] // 16) == (o_i[None, :] // 16)
    for i_t in range(0, tl.cdiv(n, BT)):
        o_t = i_t * BT + o_i
        m_t = o_t < n
        b_q = load_qk_block(q, o_t, m_t, i_b, i_h, o_k, m_k, N, H, K, USE_L2NORM) * scale
        b_k = load_qk_block(k, o_t, m_t, i_b, i_h, o_k, m_k, N, H, K, USE_L2NORM)
        b_Gt = tl.load(G + (i_b * N + o_t) * HV + i_hv, mask=m_t, other=0.)
        b_eG = tl.exp(b_Gt)
        b_beta = tl.load(beta + (i_b * N + o_t) * HV + i_hv, mask=m_t, other=0.).to(tl.float32)
        # [BT, BV]
        b_v = tl.load(v + ((i_b * N + o_t[:, None]) * HV + i_hv) * V + o_v[None, :],
                      mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
        # [BT, BT] block-diagonal inverses from the prep kernel (16-blocks past n read as 0)
        b_x = tl.load(dinv + (i_bh * N16 + o_t[:, None]) * 16 + (o_i % 16)[None, :],
                      mask=m_same & ((o_t // 16) * 16 < n)[:, None], other=0.)
        b_r = b_beta[:, None] * (b_v - b_eG[:, None] * tl.dot(b_k, b_s, input_precision=DOT_PREC))
        b_o = b_eG[:, None] * tl.dot(b_q, b_s, input_precision=DOT_PREC)
        p_w = anc + (i_b * N + o_t[:, None]) * NW
        for i_c in range(0, i_t):
            o_c = i_c * BT + o_i
            # [BT, BT] ancestor mask between rows of block t and columns of block c
            b_on = ((tl.load(p_w + (o_c // 32)[None, :], mask=m_t[:, None], other=0)
                     >> (o_c % 32)[None, :]) & 1) != 0
            b_kc = load_qk_block(k, o_c, o_c < n, i_b, i_h, o_k, m_k, N, H, K, USE_L2NORM)
            b_Gc = tl.load(G + (i_b * N + o_c) * HV + i_hv)
            b_uc = tl.load(vnew + ((i_b * N + o_c[:, None]) * HV + i_hv) * V + o_v[None, :],
                           mask=m_v[None, :], other=0.)
            b_d = tl.exp(tl.where(b_on, b_Gt[:, None] - b_Gc[None, :], float('-inf')))
            b_a = b_beta[:, None] * b_d * tl.dot(b_k, tl.trans(b_kc), input_precision=DOT_PREC)
            b_qk = b_d * tl.dot(b_q, tl.trans(b_kc), input_precision=DOT_PREC)
            b_r -= tl.dot(b_a, b_uc, input_precision=DOT_PREC)
            b_o += tl.dot(b_qk, b_uc, input_precision=DOT_PREC)
        # diagonal block
        b_on = ((tl.load(p_w + (o_t // 32)[None, :], mask=m_t[:, None], other=0)
                 >> (o_t % 32)[None, :]) & 1) != 0
        b_d = tl.exp(tl.where(b_on, b_Gt[:, None] - b_Gt[None, :], float('-inf')))
        if BT > 16:
            b_a = tl.where(o_i[:, None] > o_i[None, :], b_beta[:, None] * b_d, 0.) * \
                tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
            b_x = merge_diag_inverses(b_x, b_a, BT, DOT_PREC)
        b_qk = b_d * tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
        b_u = tl.dot(b_x, b_r, input_precision=DOT_PREC)
        b_o += tl.dot(b_qk, b_u, input_precision=DOT_PREC)
        m_st = (o_t < N)[:, None] & m_v[None, :]
        tl.store(vnew + ((i_b * N + o_t[:, None]) * HV + i_hv) * V + o_v[None, :], b_u, mask=m_st)
        tl.store(o + ((i_b * N + o_t[:, None]) * HV + i_hv) * V + o_v[None, :],
                 b_o.to(o.dtype.element_ty), mask=m_st)
        # later blocks re-read this block's V' written by other threads of the program
        tl.debug_barrier()
    # padding blocks past n
    for i_t in range(tl.cdiv(n, BT), tl.cdiv(N, BT)):
        o_t = i_t * BT + o_i
        m_st = (o_t < N)[:, None] & m_v[None, :]
        b_z = tl.zeros([BT, BV], dtype=tl.float32)
        tl.store(vnew + ((i_b * N + o_t[:, None]) * HV + i_hv) * V + o_v[None, :], b_z, mask=m_st)
        tl.store(o + ((i_b * N + o_t[:, None]) * HV + i_hv) * V + o_v[None, :],
                 b_z.to(o.dtype.element_ty), mask=m_st)

def _config(N, K, V):
    """(BT, BV, num_warps, num_stages). Measured on an H200 (benchmarks/results/gdn_tree_h200.json):
    BT=16, BV=32, 4 warps, 1 stage was fastest for n = 16..129 (BT=32/64 and BV=16/64 slower)."""
    return 16, min(32, max(16, triton.next_power_of_2(V))), 4, 1


def tree_gdn_verify(q, k, v, g, beta, parent, num_nodes, state_pool, state_idx, scale=None,
                    use_qk_l2norm=True, state_v_first=False, anc=None, precision="tf32",
                    check=True, block_t=None, block_v=None, num_warps=None, num_stages=None):
    r"""Gated DeltaNet over a tree of draft tokens; `state_pool` is only read.

    Node i sees the committed state of its request followed by the nodes on its path root..i:
    `S_i = e^{g_i} (I - beta_i k_i k_i^T) S_{parent(i)} + beta_i k_i v_i^T`, `o_i = S_i^T q_i scale`.

    Args:
        q, k: [B, N, H, K] fp32/fp16/bf16 (raw if `use_qk_l2norm`).
        v: [B, N, HV, V], HV a multiple of H (value head hv uses q/k head hv // (HV // H)).
        g: [B, N, HV] natural-log decay (<= 0).  beta: [B, N, HV] in (0, 1).
        parent: [B, N] int, -1 <= parent[b, i] < i (topological). Ignored when `anc` is given.
        num_nodes: [B] int, real nodes per request; nodes past it are padding (zero outputs).
        state_pool: [P, HV, K, V] (or [P, HV, V, K] with `state_v_first`) fp32/bf16.
        state_idx: [B] int32 slot of each request in `state_pool`; -1 = padded request.
        scale: Default: K ** -0.5.
        use_qk_l2norm: normalise q and k as x / sqrt(sum(x^2) + 1e-6). Default: True.
        anc: [B, N, ceil(N/32)] int32 from `tree_ancestor_bits`, built once per step and shared
            by all layers; built here from `parent` when None.
        precision: `tl.dot` input precision on GPU, "tf32" | "tf32x3" | "ieee".
        check: validate `parent` on the host when building `anc` (syncs). Default: True.
        block_t, block_v, num_warps, num_stages: tuning overrides (block_t in 16, 32, 64).
    Returns:
        o: [B, N, HV, V] in v.dtype.
        stash: `GDNTreeStash` for `tree_gdn_commit`.

    Example::
        >>> o, stash = tree_gdn_verify(q, k, v, g, beta, parent, num_nodes, pool, state_idx)
        >>> tree_gdn_commit(pool, state_idx, accepted_leaf, stash)
    """
    B, N, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (B, N) or HV % H != 0:
        raise ValueError(f"expected q, k [B, N, H, K] and v [B, N, HV, V] with HV % H == 0, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if g.shape != (B, N, HV) or beta.shape != (B, N, HV):
        raise ValueError(f"expected g and beta of shape {(B, N, HV)}, got {tuple(g.shape)} and "
                         f"{tuple(beta.shape)}")
    want = (HV, V, K) if state_v_first else (HV, K, V)
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != want:
        raise ValueError(f"expected state_pool [P, {', '.join(map(str, want))}], "
                         f"got {tuple(state_pool.shape)}")
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous (it is indexed by slot, head and layout)")
    if N > MAX_NODES or K > 256:
        raise ValueError(f"supports N <= {MAX_NODES} and K <= 256, got N={N}, K={K}")
    if anc is None:
        anc = tree_ancestor_bits(parent, num_nodes, check=check)
    scale = K ** -0.5 if scale is None else scale
    BT, BV, nw, ns = _config(N, K, V)
    BT, BV, nw, num_stages = block_t or BT, block_v or BV, num_warps or nw, num_stages or ns
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty_like(v)
    vnew = torch.empty(B, N, HV, V, dtype=torch.float32, device=v.device)
    G = torch.empty(B, N, HV, dtype=torch.float32, device=v.device)
    N16 = triton.cdiv(N, 16) * 16
    dinv = torch.empty(B * HV, N16, 16, dtype=torch.float32, device=v.device)
    anc, num_nodes, state_idx = anc.contiguous(), num_nodes.contiguous(), state_idx.contiguous()
    BK = max(16, triton.next_power_of_2(K))
    tree_gdn_prep_kernel[(N16 // 16, B * HV)](
        k, g, beta, anc, num_nodes, state_idx, G, dinv, N=N, H=H, HV=HV, K=K, NW=anc.shape[-1],
        N16=N16, BK=BK, USE_L2NORM=use_qk_l2norm, DOT_PREC=precision, num_warps=1)
    tree_gdn_fwd_kernel[(triton.cdiv(V, BV), B * HV)](
        q, k, v, beta, anc, num_nodes, state_pool, state_idx, o, vnew, G, dinv, scale, N=N, H=H,
        HV=HV, K=K, V=V, NW=anc.shape[-1], N16=N16, BT=BT, BK=BK, BV=BV,
        USE_L2NORM=use_qk_l2norm, STATE_V_FIRST=state_v_first, DOT_PREC=precision,
        num_warps=nw, num_stages=num_stages)
    return o, GDNTreeStash(k, vnew, G, anc, use_qk_l2norm, state_v_first)
