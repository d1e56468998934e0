"""Tree-masked Gated DeltaNet verify: outputs for every node, the committed state read-only.

Two launches. `tree_gdn_prep_kernel` (prep.py; one program per diagonal BT-node block and one per
BC-column tile below it, per request and value head, all in parallel) writes the path-summed decay
G, the inverse q/k norms, the stacked off-diagonal rows AP_t = [A_t,<t ; -P_t,<t] of A
(beta_i D_ij k_i.k_j) and P (D_ij q_i.k_j), and the block matrices W_t = [[T_t, 0], [P_tt T_t, I]]
with T_t = (I + A_tt)^{-1}.
`tree_gdn_solve_kernel` (one program per V-tile, request and value head) is the only serial part,
block forward substitution over the blocks t with the stacked [2BT, BV] tiles
    Y_t          = [beta (V_t - e^G K_t S0) ; e^G Q_t S0] - AP_t V'_<t
    [V'_t ; O_t] = W_t Y_t
The first term is one dot of the stacked [k_t ; q_t] rows with S0 (off the serial chain: the next
block's rows are read while the current one waits); the second takes all earlier blocks at once
([2BT, NPAD] @ [NPAD, BV]), re-reading V'_<t from the `vnew` stash this program wrote.
"""
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..launch import pdl_supported
from .prep import state_dot, state_split, tree_gdn_prep_kernel
from .tree import MAX_NODES, check_parents, tree_ancestor_bits


class GDNTreeStash(NamedTuple):
    """What `tree_gdn_commit` needs from a verify: raw keys, corrected values, path decay, tree."""
    k: torch.Tensor      # [B, N, H, K] (the verify input, not a copy)
    vnew: torch.Tensor   # [B, N, HV, V] fp32
    G: torch.Tensor      # [B, N, HV] fp32
    anc: torch.Tensor    # [B, N, ceil(N/32)] int32
    use_qk_l2norm: bool
    state_v_first: bool


@triton.jit
def load_rows(q, k, v, beta, rows, n, i_b, i_h, i_hv, N, H, HV, K, V, o_k, o_v, m_v,
              BT: tl.constexpr):
    """One block's input tiles for the stacked rows (r < BT: node rows[r] of the k half, else the q
    half): raw [k ; q] [2BT, BK], beta [2BT] and v [2BT, BV] (zero in the q half)."""
    o_r = tl.arange(0, 2 * BT)
    m_top = o_r < BT
    m_r = rows < n
    p_x = tl.where(m_top, k, q) + ((i_b * N + rows) * H + i_h) * K
    b_x = tl.load(p_x[:, None] + o_k[None, :], mask=m_r[:, None] & (o_k < K)[None, :], other=0.)
    b_beta = tl.load(beta + (i_b * N + rows) * HV + i_hv, mask=m_r & m_top, other=0.).to(tl.float32)
    b_v = tl.load(v + ((i_b * N + rows[:, None]) * HV + i_hv) * V + o_v[None, :],
                  mask=(m_r & m_top)[:, None] & m_v[None, :], other=0.).to(tl.float32)
    return b_x, b_beta, b_v


@triton.jit
def load_scales(G, RN, rows, n, g0, i_b, i_hv, i_bh, N, HV, BT: tl.constexpr):
    """The prep's per-row factors for the stacked rows: e^(G - g0) and the inverse k (or q) norm
    [2BT] (g0: the root's decay where the solve folded the root into the state, else 0)."""
    o_r = tl.arange(0, 2 * BT)
    m_r = rows < n
    b_eG = tl.exp(tl.where(m_r, tl.load(G + (i_b * N + rows) * HV + i_hv, mask=m_r, other=0.) - g0, 0.))
    b_rn = tl.load(RN + (i_bh * 2 + (o_r >= BT)) * N + rows, mask=m_r, other=0.)
    return b_eG, b_rn


@triton.jit
def fold_root(q, k, v, g, beta, vnew, o, b_s, n, scale, i_b, i_h, i_hv, N, H, HV, K, V, o_k, o_v,
              m_v, USE_L2NORM: tl.constexpr):
    """Node 0, the ancestor of every node, folded into the state tile b_s [BK, BV] (fp32 sums):
    v'_0 = beta_0 (v_0 - e^g_0 k_0 S0), S_root = e^g_0 S0 + k_0 v'_0^T, o_0 = q_0 S_root, stored
    to vnew and o. Returns (S_root tile, g_0); the other nodes then see S_root and e^(G - g_0)."""
    m_0 = n > 0
    m_k = o_k < tl.where(m_0, K, 0)                    # (a block-shaped mask: the interpreter
    m_v0 = o_v < tl.where(m_0, V, 0)                   # rejects a scalar & block one)
    b_k = tl.load(k + (i_b * N * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_q = tl.load(q + (i_b * N * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_v = tl.load(v + (i_b * N * HV + i_hv) * V + o_v, mask=m_v0, other=0.).to(tl.float32)
    b_g0 = tl.where(m_0, tl.load(g + i_b * N * HV + i_hv).to(tl.float32), 0.)
    b_beta0 = tl.where(m_0, tl.load(beta + i_b * N * HV + i_hv).to(tl.float32), 0.)
    if USE_L2NORM:
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
    b_e = tl.exp(b_g0)
    b_vn = b_beta0 * (b_v - b_e * tl.sum(b_k[:, None] * b_s, 0))                      # [BV]
    b_s = b_e * b_s + b_k[:, None] * b_vn[None, :]
    b_o = tl.sum((b_q * scale)[:, None] * b_s, 0)
    p_0 = (i_b * N * HV + i_hv) * V + o_v
    tl.store(vnew + p_0, b_vn, mask=m_v)
    tl.store(o + p_0, b_o.to(o.dtype.element_ty), mask=m_v)
    return b_s, b_g0


@triton.jit(do_not_specialize=["N", "H", "HV", "NB"])
def tree_gdn_solve_kernel(
    q, k, v, g, beta, state, state_idx, num_nodes, G, RN, AP, W, vnew, o, scale, N, H, HV, K, V, NB,
    NPAD, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr, ROOT: tl.constexpr,
    USE_L2NORM: tl.constexpr,
):
    """ROOT = 1: node 0 is every node's ancestor; it is folded into the state tile first
    (`fold_root`) and the blocks cover nodes 1 .. N-1 (block t: nodes 1 + t BT ..)."""
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
    g0 = 0.
    if ROOT:
        b_s, g0 = fold_root(q, k, v, g, beta, vnew, o, b_s, n, scale, i_b, i_h, i_hv, N, H, HV, K, V,
                            o_k, o_v, m_v, USE_L2NORM)
    n_loc = tl.maximum(n - ROOT, 0)                    # nodes in the blocks
    b_sh, b_sl = state_split(b_s, q.dtype.element_ty)
    # rows of the stacked [2BT, *] tiles: r < BT is node t BT + r of the V' (k) half, r >= BT the
    # same node of the O (q) half
    o_r = tl.arange(0, 2 * BT)
    m_top = o_r < BT
    # the next block's own tiles are read while this block waits on V', so each serial step waits on
    # one round trip, for the V' it re-reads. With programmatic dependent launch (PDL) this program
    # may start while the prep still runs: S0 and the first block's input rows are read before
    # gdc_wait, which then waits for the prep's outputs. Reading inputs early is safe because the
    # prep signals dependents only after its own gdc_wait, i.e. once every kernel that wrote them
    # has finished.
    b_x, b_beta, b_v = load_rows(q, k, v, beta, ROOT + o_r % BT, n, i_b, i_h, i_hv, N, H, HV, K,
                                 V, o_k, o_v, m_v, BT)
    if PDL:
        tl.extra.cuda.gdc_wait()
    b_eG, b_rn = load_scales(G, RN, ROOT + o_r % BT, n, g0, i_b, i_hv, i_bh, N, HV, BT)
    for i_t in range(0, tl.cdiv(n_loc, BT)):
        rows = ROOT + i_t * BT + o_r % BT
        b_c = tl.where(m_top, -b_beta, 1.) * b_eG * b_rn
        # [2BT, BV] = [beta (v - e^G rk k S0) ; e^G rq q S0]
        b_y = b_beta[:, None] * b_v + b_c[:, None] * state_dot(b_x, b_sh, b_sl, DOT_PREC)
        # the next block's rows (all masked past the last block)
        b_x, b_beta, b_v = load_rows(q, k, v, beta, rows + BT, n, i_b, i_h, i_hv, N, H, HV, K,
                                     V, o_k, o_v, m_v, BT)
        b_eG, b_rn = load_scales(G, RN, rows + BT, n, g0, i_b, i_hv, i_bh, N, HV, BT)
        p_blk = (i_bh * NB + i_t) * 2 * BT
        # [2BT, 2BT] W_t, read here with the AP tiles and the earlier V' (one round trip per block):
        # read after the loop below, its loads would wait for the loop's dots
        b_w = tl.load(W + (p_blk + o_r[:, None]) * 2 * BT + o_r[None, :])
        # all earlier nodes at once (KC columns per dot; one dot for trees of up to 129 nodes)
        for i_c in range(0, tl.cdiv(i_t * BT, KC)):
            o_c = i_c * KC + tl.arange(0, KC)
            m_c = o_c < i_t * BT
            # [2BT, KC] and [KC, BV] (nodes ROOT + o_c); columns of later blocks are masked to zero
            b_ap = tl.load(AP + (p_blk + o_r[:, None]) * NPAD + o_c[None, :], mask=m_c[None, :],
                           other=0.)
            b_u = tl.load(vnew + ((i_b * N + ROOT + o_c[:, None]) * HV + i_hv) * V + o_v[None, :],
                          mask=m_c[:, None] & m_v[None, :], other=0.)
            b_y -= tl.dot(b_ap, b_u, input_precision=DOT_PREC)
        # [2BT, 2BT] @ [2BT, BV] -> [V'_t ; O_t]
        b_z = tl.dot(b_w, b_y, input_precision=DOT_PREC)
        p_out = ((i_b * N + rows[:, None]) * HV + i_hv) * V + o_v[None, :]
        m_st = (rows < N)[:, None] & m_v[None, :]
        tl.store(vnew + p_out, b_z, mask=m_st & m_top[:, None])
        tl.store(o + p_out, b_z.to(o.dtype.element_ty), mask=m_st & (o_r >= BT)[:, None])
        # later blocks re-read this block's V' written by other threads of the program
        tl.debug_barrier()
    # padding blocks past n
    o_i = tl.arange(0, BT)
    for i_t in range(tl.cdiv(n_loc, BT), tl.cdiv(N - ROOT, BT)):
        rows = ROOT + i_t * BT + o_i
        p_out = ((i_b * N + rows[:, None]) * HV + i_hv) * V + o_v[None, :]
        m_st = (rows < N)[:, None] & m_v[None, :]
        b_z = tl.zeros([BT, BV], dtype=tl.float32)
        tl.store(vnew + p_out, b_z, mask=m_st)
        tl.store(o + p_out, b_z.to(o.dtype.element_ty), mask=m_st)


@dataclass(frozen=True)
class GDNTuning:
    """Launch parameters of `tree_gdn_verify`; `GDNTuning.for_shape(N, device)` is the default.

    block_t: nodes per block of the prep and of the serial solve (16, 32 or 64).
    block_v: V columns per solve program.
    num_warps: warps per solve program.
    block_c: columns per off-diagonal tile program of the prep (a power of 2 >= 16).
    solve_kc: columns of earlier nodes per dot in the solve (a power of 2 >= 16). Wider dots need
        more registers per program, so fewer programs fit on an SM.
    prep_warps: warps per prep program (per tile program with `prep_split`).
    diag_warps: warps per diagonal program with `prep_split`.
    inv_base: the diagonal blocks' inverses (I + A_tt)^{-1} by forward substitution over blocks of
        this many nodes (4, 8 or 16), merged up to block_t by doublings of dots (in tf32x3 where
        the verify's precision is tf32): 16 is 15 serial steps for 16-node blocks, 8 is 7 steps and
        two dots, 4 is 3 steps and four dots.
    prep_split: the prep as two launches, the diagonal programs (which store G and the inverse
        norms) and then the off-diagonal tiles, which read them back instead of re-deriving them
        from the ancestor words and q/k: fewer registers per tile program, so more programs per
        SM, for one more launch.
    pdl: launch both kernels with programmatic dependent launch, so that the solve starts (reads S0
        and its first rows) while the prep runs. Needs a CUDA device of compute capability >= 9
        and a Triton that supports it (`tfm_kernels.launch.pdl_supported`).
    """
    block_t: int
    block_v: int
    num_warps: int
    block_c: int
    solve_kc: int
    prep_warps: int
    diag_warps: int
    inv_base: int
    prep_split: bool
    pdl: bool

    def __post_init__(self):
        if self.block_t not in (16, 32, 64):
            raise ValueError(f"block_t must be 16, 32 or 64, got {self.block_t}")
        if self.inv_base not in (4, 8, 16):
            raise ValueError(f"inv_base must be 4, 8 or 16, got {self.inv_base}")
        for name in ("block_v", "block_c", "solve_kc"):
            x = getattr(self, name)
            if x < 16 or x & (x - 1):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {x}")

    @classmethod
    def for_shape(cls, N: int, device: torch.device | None = None) -> "GDNTuning":
        """The default for trees of up to N nodes, chosen at the Qwen3.6-27B shape (B=1, HV=48,
        K=V=128) and valid for any. PDL only on a `device` that supports it (None: no PDL).
        """
        return cls(
            block_t=16, block_v=16, block_c=32, solve_kc=64, diag_warps=4, inv_base=8,
            # from 49 nodes the solve's programs stall on each other at 4 warps
            num_warps=2 if N > 48 else 4,
            prep_warps=4 if 48 < N <= 96 else 2,
            # above 96 nodes the one-launch prep's programs run in several waves; the split prep's
            # tile programs need fewer registers, so more of them fit on an SM
            prep_split=N > 96,
            # with the split prep a plain launch is faster
            pdl=N <= 96 and device is not None and pdl_supported(device),
        )


def root_folded(single_root, N: int, BT: int) -> int:
    """1 where the solve folds node 0 into the state (`single_root`): only where that saves a serial
    block (N = 1 mod BT), else 0."""
    return int(bool(single_root) and N > 1 and N % BT == 1)


def tree_gdn_verify(q, k, v, g, beta, parent, num_nodes, state_pool, state_idx, scale=None,
                    use_qk_l2norm=True, state_v_first=False, anc=None, precision="tf32", check=True,
                    single_root=None, tuning: GDNTuning | None = None, stages=("prep", "solve")):
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
        single_root: node 0 is an ancestor of every real node of every request (a tree rooted at
            node 0, as a decoder's verify trees are). Then when N = 1 (mod block_t), the solve
            folds node 0 into the state first (a rank-1 update of each state tile) and the
            blocks cover nodes 1 .. N-1: one serial block fewer (n = 65, 129: 4 and 8 blocks
            instead of 5 and 9). None (default): read off `parent` where `check` validates it
            on the host anyway, else False. True is validated when `check` is on.
        tuning: launch parameters. Default: `GDNTuning.for_shape(N, v.device)`.
        stages: which launches run (benchmarks time the prep and the solve apart; a subset
            leaves the outputs undefined): "prep" (both prep launches), "solve", and with
            `tuning.prep_split` "diag" or "tiles" for one of the two prep launches.
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
        rooted = check_parents(parent, num_nodes) if check else None      # one host read for both
        if single_root and rooted is False:
            raise ValueError("single_root=True, but a real node other than node 0 has parent -1 (node 0 must "
                             "be an ancestor of every node)")
        single_root = bool(rooted) if single_root is None else single_root
        anc = tree_ancestor_bits(parent, num_nodes, check=False)
    elif tuple(anc.shape) != (B, N, triton.cdiv(N, 32)):
        raise ValueError(f"expected anc [B, N, ceil(N/32)] = {(B, N, triton.cdiv(N, 32))}, "
                         f"got {tuple(anc.shape)}")
    scale = K ** -0.5 if scale is None else scale
    tuning = GDNTuning.for_shape(N, v.device) if tuning is None else tuning
    if not isinstance(tuning, GDNTuning):
        raise TypeError(f"tuning must be a GDNTuning, got {type(tuning).__name__}")
    if tuning.pdl and not pdl_supported(v.device):
        raise ValueError(f"pdl=True needs a CUDA device of compute capability >= 9 and a Triton with "
                         f"gdc_wait/launch_pdl (not under TRITON_INTERPRET), got {v.device} and Triton "
                         f"{triton.__version__}")
    BT, pdl = tuning.block_t, tuning.pdl
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    anc, num_nodes, state_idx = anc.contiguous(), num_nodes.contiguous(), state_idx.contiguous()
    dev, f32 = v.device, torch.float32
    ROOT = root_folded(single_root, N, BT)
    NB = triton.cdiv(N - ROOT, BT)
    # columns of the off-diagonal rows: every node of blocks 0 .. NB-2
    NPAD = max(16, triton.next_power_of_2((NB - 1) * BT))
    BK = max(16, triton.next_power_of_2(K))
    o = torch.empty_like(v)
    vnew = torch.empty(B, N, HV, V, dtype=f32, device=dev)
    G = torch.empty(B, N, HV, dtype=f32, device=dev)
    RN = torch.empty(B * HV, 2, N, dtype=f32, device=dev)
    AP = torch.empty(B * HV, NB, 2 * BT, NPAD, dtype=f32, device=dev)
    W = torch.empty(B * HV, NB, 2 * BT, 2 * BT, dtype=f32, device=dev)
    BC = min(NPAD, tuning.block_c)
    # off-diagonal tiles: block t has cdiv(t BT, BC) of BC columns
    NT = sum(triton.cdiv(t * BT, BC) for t in range(1, NB))
    launch = {"launch_pdl": True} if pdl else {}
    if {"prep", "diag", "tiles"} & set(stages):
        inv_base = tuning.inv_base
        # one launch of NB diagonal + NT tile programs, or (prep_split) the diagonal programs,
        # then the tiles reading the G and norms they stored
        parts = [(1, NB), (2, NT)] if tuning.prep_split else [(0, NB + NT)]
        for part, programs in parts:
            if programs and ("prep" in stages or {1: "diag", 2: "tiles"}.get(part) in stages):
                tree_gdn_prep_kernel[(programs, B * HV)](
                    q, k, g, beta, anc, num_nodes, state_idx, G, RN, AP, W, scale, N, H, HV, K, NB,
                    NPAD, NW=anc.shape[-1], BT=BT, BK=BK, BC=BC, USE_L2NORM=use_qk_l2norm,
                    DOT_PREC=precision, PDL=pdl, PART=part, ROOT=ROOT, INV_BASE=inv_base,
                    INV_PREC="tf32x3" if precision == "tf32" and inv_base < BT else precision,
                    num_warps=tuning.diag_warps if part == 1 else tuning.prep_warps,
                    **launch)
    if "solve" in stages:
        tree_gdn_solve_kernel[(triton.cdiv(V, tuning.block_v), B * HV)](
            q, k, v, g, beta, state_pool, state_idx, num_nodes, G, RN, AP, W, vnew, o, scale, N, H,
            HV, K, V, NB, NPAD, BT=BT, BK=BK, BV=tuning.block_v, KC=min(NPAD, tuning.solve_kc),
            STATE_V_FIRST=state_v_first, DOT_PREC=precision, PDL=pdl, ROOT=ROOT,
            USE_L2NORM=use_qk_l2norm, num_warps=tuning.num_warps, num_stages=1, **launch)
    return o, GDNTreeStash(k, vnew, G, anc, use_qk_l2norm, state_v_first)
