"""Candidate log-probs with LM-head rows shared across a group of query rows (training).

`candidate_log_probs` gathers weight[cand[m, c]] once per (query m, candidate c): M*Kc*Dm elements each way.
Real candidate sets overlap: a Weaver row's 15 depths, and neighbouring rows, propose many of the same tokens
(benchmarks/results/README.md). Here the
queries are cut into groups of G consecutive rows; each group's distinct candidate ids (its union, U of them)
are read once and scored against all G queries with a tensor-core dot:

    S[g, q, u]      = hidden[g G + q] . weight[union[g, u]]                   (`grouped_scores_kernel`)
    logits[m, c]    = S[m // G, m % G, pos[m, c]] * inv_t + bias[m, c]        (pos: index of cand[m, c] in the union)
    logprobs        = log_softmax over the valid candidates of each row       (`grouped_logprobs_kernel`)
    dS[g, q, u]     = inv_t * sum_{c: pos[m, c] = u} dlogits[m, c]             (`grouped_logits_grad_kernel`)
    dhidden[g G + q] = sum_u dS[g, q, u] weight[union[g, u]]                  (`grouped_hidden_grad_kernel`)

Weight traffic per pass: NG*U*Dm instead of M*Kc*Dm; the price is a dense fp32 [G, U] score (and gradient)
scratch per group, 4*G*U bytes, processed in chunks of groups. Benchmark: benchmarks/kernels/bench_grouped_scoring.py.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .union import group_union


@triton.jit
def grouped_scores_kernel(hidden, weight, union, count, scores, s_hm, s_wv, M, U, Dm, V,
                          G: tl.constexpr, GQ: tl.constexpr, BU: tl.constexpr, BD: tl.constexpr,
                          DOT_PREC: tl.constexpr):
    """scores[g, q, u-block] = hidden[g G + q] . weight[union[g, u]] for q < G (fp32, 0 at pads).

    Grid (cdiv(U, BU), groups): a group's programs run next to each other, so its hidden rows are read
    from HBM once and from L2 by the others. hidden [M, Dm]; weight [V, Dm]; union int64 [groups, U]
    (-1 = none); count int32 [groups] (union entries in use: programs past it return at once, their
    scores are never read); scores fp32 [groups, GQ, U] with GQ >= G a power of 2 >= 16 (rows q >= G
    are not written).
    """
    i_u, i_g = tl.program_id(0), tl.program_id(1).to(tl.int64)
    if i_u * BU >= tl.load(count + i_g):
        return
    o_q = tl.arange(0, GQ)
    rows = i_g * G + o_q
    m_q = (o_q < G) & (rows < M)
    o_u = i_u * BU + tl.arange(0, BU)
    ids = tl.load(union + i_g * U + o_u, mask=o_u < U, other=-1)
    valid = (ids >= 0) & (ids < V)
    p_w = weight + tl.where(valid, ids, 0)[:, None] * s_wv
    acc = tl.zeros([GQ, BU], dtype=tl.float32)
    for d0 in range(0, Dm, BD):
        o_d = d0 + tl.arange(0, BD)
        m_d = o_d < Dm
        b_h = tl.load(hidden + rows[:, None] * s_hm + o_d[None, :], mask=m_q[:, None] & m_d[None, :],
                      other=0.)                                                          # [GQ, BD]
        b_w = tl.load(p_w + o_d[None, :], mask=valid[:, None] & m_d[None, :], other=0.)  # [BU, BD]
        acc += tl.dot(b_h, tl.trans(b_w), input_precision=DOT_PREC)
    tl.store(scores + (i_g * GQ + o_q[:, None]) * U + o_u[None, :], acc, mask=m_q[:, None] & (o_u < U)[None, :])


@triton.jit
def grouped_hidden_grad_kernel(dscores, weight, union, count, dhidden, s_wv, M, U, Dm, V,
                               G: tl.constexpr, GQ: tl.constexpr, BU: tl.constexpr, BD: tl.constexpr,
                               DOT_PREC: tl.constexpr, ROUND16: tl.constexpr):
    """dhidden[g G + q, d-block] = sum_u dscores[g, q, u] weight[union[g, u], d-block].

    dscores fp32: an fp32 dot of `DOT_PREC`, or with ROUND16 each tile rounded to the weight's 16-bit dtype for a
    16-bit dot (fp32 sums), as the backward of a 16-bit linear layer does.

    Grid (cdiv(Dm, BD), groups): a group's programs run next to each other and share its dscores
    through L2. dscores [groups, GQ, U], read only below count; count int32 [groups] (union entries in use;
    the loop stops there);
    dhidden [M, Dm]. The next block's union ids are read before this block's weight rows, so the rows'
    addresses do not wait on a load in the same step.
    """
    i_d, i_g = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_q = tl.arange(0, GQ)
    rows = i_g * G + o_q
    m_q = (o_q < G) & (rows < M)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < Dm
    acc = tl.zeros([GQ, BD], dtype=tl.float32)
    ids_next = tl.load(union + i_g * U + tl.arange(0, BU), mask=tl.arange(0, BU) < U, other=-1)
    n_u = tl.load(count + i_g)
    for u0 in range(0, n_u, BU):
        o_u = u0 + tl.arange(0, BU)
        ids = ids_next
        ids_next = tl.load(union + i_g * U + o_u + BU, mask=o_u + BU < U, other=-1)
        valid = (ids >= 0) & (ids < V)
        b_w = tl.load(weight + tl.where(valid, ids, 0)[:, None] * s_wv + o_d[None, :],
                      mask=valid[:, None] & m_d[None, :], other=0.)                     # [BU, BD]
        b_s = tl.load(dscores + (i_g * GQ + o_q[:, None]) * U + o_u[None, :],
                      mask=(o_u < n_u)[None, :], other=0.)                              # [GQ, BU]
        if ROUND16:
            acc += tl.dot(b_s.to(b_w.dtype), b_w)
        else:
            acc += tl.dot(b_s, b_w.to(tl.float32), input_precision=DOT_PREC)
    tl.store(dhidden + rows[:, None] * Dm + o_d[None, :], acc.to(dhidden.dtype.element_ty),
             mask=m_q[:, None] & m_d[None, :])


@triton.jit
def grouped_logprobs_kernel(scores, pos, bias, logprobs, row0, Kc, U, inv_t, G: tl.constexpr, GQ: tl.constexpr,
                            BK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """logprobs[m] = log_softmax over the valid candidates of scores[g, q, pos[m, c]] * inv_t + bias[m, c], for the
    query row m = row0 + r of program r (g = r // G, q = r % G: the scores of this chunk of groups).

    scores fp32 [groups, GQ, U]; pos int32 [M, Kc] (-1 = pad); bias [M, Kc] (any float dtype) if HAS_BIAS;
    logprobs fp32 [M, Kc], -inf at pads (all -inf in a row with no valid candidate). BK >= Kc, a power of 2.
    """
    r = tl.program_id(0).to(tl.int64)
    m = row0 + r
    o_c = tl.arange(0, BK)
    p = tl.load(pos + m * Kc + o_c, mask=o_c < Kc, other=-1)
    valid = p >= 0
    x = tl.load(scores + ((r // G) * GQ + r % G) * U + tl.where(valid, p, 0), mask=valid, other=0.) * inv_t
    if HAS_BIAS:
        x += tl.load(bias + m * Kc + o_c, mask=valid, other=0.).to(tl.float32)
    x = tl.where(valid, x, float("-inf"))
    top = tl.max(x, 0)
    top = tl.where(top == float("-inf"), 0., top)                    # a row of pads: exp gives 0, never NaN
    lse = top + tl.log(tl.maximum(tl.sum(tl.exp(x - top), 0), 1.))    # >= 1 with any valid candidate
    tl.store(logprobs + m * Kc + o_c, tl.where(valid, x - lse, float("-inf")), mask=o_c < Kc)


@triton.jit
def zero_scores_kernel(dscores, count, U, BZ: tl.constexpr):
    """dscores[g, q, :count[g]] = 0 for every row q. Grid (GQ, groups of this chunk); dscores fp32 [groups, GQ, U]
    (the entries from count on are never read)."""
    q, g = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    n = tl.load(count + g)
    row = dscores + (g * tl.num_programs(0) + q) * U
    for u0 in range(0, n, BZ):
        o_u = u0 + tl.arange(0, BZ)
        tl.store(row + o_u, tl.zeros([BZ], dtype=tl.float32), mask=o_u < n)


@triton.jit
def grouped_logits_grad_kernel(gout, s_gm, s_gc, logprobs, pos, dscores, dlogits, row0, Kc, U, inv_t,
                               G: tl.constexpr, GQ: tl.constexpr, BK: tl.constexpr, STORE_DL: tl.constexpr):
    """The log-softmax's backward for the query row m = row0 + r of program r, scattered into its group's scores:

        dl[c]                           = g[c] - exp(logprobs[m, c]) * sum_c g[c]     (g = gout[m], 0 at pads)
        dscores[r // G, r % G, pos[m, c]] += inv_t * dl[c]                          (atomic: duplicate ids add up)

    gout [M, Kc] (strides s_gm, s_gc; any float dtype); logprobs fp32 [M, Kc]; pos int32 [M, Kc] (-1 = pad);
    dscores fp32 [groups, GQ, U] of this chunk, zeroed up to each group's count (`zero_scores_kernel`); dlogits fp32
    [M, Kc] (written if STORE_DL: the bias gradient).
    """
    r = tl.program_id(0).to(tl.int64)
    m = row0 + r
    o_c = tl.arange(0, BK)
    p = tl.load(pos + m * Kc + o_c, mask=o_c < Kc, other=-1)
    valid = p >= 0
    g = tl.load(gout + m * s_gm + o_c * s_gc, mask=valid, other=0.).to(tl.float32)
    lp = tl.load(logprobs + m * Kc + o_c, mask=valid, other=float("-inf"))
    dl = g - tl.exp(lp) * tl.sum(g, 0)                                                  # 0 at pads
    if STORE_DL:
        tl.store(dlogits + m * Kc + o_c, dl, mask=o_c < Kc)
    tl.atomic_add(dscores + ((r // G) * GQ + r % G) * U + tl.where(valid, p, 0), dl * inv_t, mask=valid,
                  sem="relaxed")


@dataclass(frozen=True)
class GroupedTuning:
    """Launch parameters of `grouped_candidate_log_probs`; `GroupedTuning.for_shape(M, Kc, Dm, group)` is the
    default.

    fwd_bu, fwd_bd: union rows x hidden columns per step of the forward's score kernel; bwd_bu, bwd_bd: union
    rows per step x hidden columns per program of the backward's hidden-gradient kernel (all powers of 2 >= 16);
    num_warps, num_stages: launch options of both.
    """
    fwd_bu: int
    fwd_bd: int
    bwd_bu: int
    bwd_bd: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("fwd_bu", "fwd_bd", "bwd_bu", "bwd_bd"):
            x = getattr(self, name)
            if x < 16 or x & (x - 1):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {x}")

    @classmethod
    def for_shape(cls, M: int, Kc: int, Dm: int, group: int) -> "GroupedTuning":
        """The default for M query rows of Kc candidates, hidden size Dm, `group` rows per group.

        The forward in blocks of up to 64 x 64; the backward in 32 union rows x 512 hidden columns (256 from 128
        query rows per group up); 8 warps from 64 query rows per group up. The wide hidden blocks matter: each of
        a group's Dm / bwd_bd programs reads the group's whole score gradient through L2.
        """
        U = min(group, M) * Kc                                              # the union's capacity
        BU = min(64, max(16, triton.next_power_of_2(U)))
        GQ = _padded_rows(group)
        return cls(fwd_bu=BU, fwd_bd=min(64, max(16, triton.next_power_of_2(Dm))), bwd_bu=min(32, BU),
                   bwd_bd=min(512 if GQ <= 64 else 256, max(16, triton.next_power_of_2(Dm))),
                   num_warps=8 if GQ >= 64 else 4, num_stages=3)


def _padded_rows(group: int) -> int:
    """GQ: a group's query rows padded to a power of 2 >= 16 (the rows of its score tiles)."""
    return max(16, triton.next_power_of_2(group))


def _dot_prec(precision: str) -> str:
    """`tl.dot` input precision of the fp32 dots: "bf16" mode has none in the backward and 16-bit
    products in the forward, where any setting is exact."""
    return "tf32" if precision == "bf16" else precision


class _GroupedCandidateLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, cand, bias, inv_t, group, precision, chunk_bytes, tuning):
        M, Kc = cand.shape
        Dm, V = weight.shape[1], weight.shape[0]
        union, pos, count = group_union(cand, group, V)
        NG, U = union.shape
        GQ, BK = _padded_rows(group), max(16, triton.next_power_of_2(Kc))
        chunk = max(1, chunk_bytes // (GQ * U * 4))                          # groups per scratch chunk
        inv_t = 1.0 if inv_t is None else inv_t
        logprobs = torch.empty(M, Kc, dtype=torch.float32, device=hidden.device)
        for g0 in range(0, NG, chunk):
            g1 = min(NG, g0 + chunk)
            r0, r1 = g0 * group, min(M, g1 * group)
            S = torch.empty(g1 - g0, GQ, U, dtype=torch.float32, device=hidden.device)
            grouped_scores_kernel[(triton.cdiv(U, tuning.fwd_bu), g1 - g0)](
                hidden[r0:r1], weight, union[g0:g1], count[g0:g1], S, hidden.stride(0), weight.stride(0), r1 - r0,
                U, Dm, V,
                G=group, GQ=GQ, BU=tuning.fwd_bu, BD=tuning.fwd_bd, DOT_PREC=_dot_prec(precision),
                num_warps=tuning.num_warps, num_stages=tuning.num_stages)
            grouped_logprobs_kernel[(r1 - r0,)](S, pos, bias, logprobs, r0, Kc, U, inv_t, G=group, GQ=GQ, BK=BK,
                                                HAS_BIAS=bias is not None, num_warps=4)
        ctx.save_for_backward(weight, union, count, pos, logprobs)
        ctx.inv_t, ctx.hidden_dtype, ctx.group = inv_t, hidden.dtype, group
        ctx.tuning, ctx.chunk, ctx.precision = tuning, chunk, precision
        return logprobs

    @staticmethod
    def backward(ctx, g):
        weight, union, count, pos, logprobs = ctx.saved_tensors
        tuning, group, chunk, inv_t = ctx.tuning, ctx.group, ctx.chunk, ctx.inv_t
        dlogits = None
        if not ctx.needs_input_grad[0]:
            # the bias gradient alone: the log-softmax's backward, no LM-head rows
            if ctx.needs_input_grad[3]:
                g = torch.where(pos >= 0, g.float(), 0.0)
                dlogits = g - torch.exp(logprobs) * g.sum(-1, keepdim=True)       # exp(-inf) = 0 at pads
            return None, None, None, dlogits, None, None, None, None, None
        GQ = _padded_rows(group)
        M, Kc = pos.shape
        Dm, V = weight.shape[1], weight.shape[0]
        NG, U = union.shape
        BK = max(16, triton.next_power_of_2(Kc))
        dhidden = torch.empty(M, Dm, dtype=ctx.hidden_dtype, device=weight.device)
        if ctx.needs_input_grad[3]:
            dlogits = torch.empty(M, Kc, dtype=torch.float32, device=weight.device)
        for g0 in range(0, NG, chunk):
            g1 = min(NG, g0 + chunk)
            r0, r1 = g0 * group, min(M, g1 * group)
            dS = torch.empty(g1 - g0, GQ, U, dtype=torch.float32, device=weight.device)
            zero_scores_kernel[(GQ, g1 - g0)](dS, count[g0:g1], U, BZ=1024, num_warps=4)
            grouped_logits_grad_kernel[(r1 - r0,)](
                g, g.stride(0), g.stride(1), logprobs, pos, dS, dlogits, r0, Kc, U, inv_t, G=group, GQ=GQ, BK=BK,
                STORE_DL=dlogits is not None, num_warps=4)
            grouped_hidden_grad_kernel[(triton.cdiv(Dm, tuning.bwd_bd), g1 - g0)](
                dS, weight, union[g0:g1], count[g0:g1], dhidden[r0:r1], weight.stride(0), r1 - r0, U, Dm, V,
                G=group, GQ=GQ, BU=tuning.bwd_bu, BD=tuning.bwd_bd, DOT_PREC=_dot_prec(ctx.precision),
                ROUND16=ctx.precision == "bf16", num_warps=tuning.num_warps, num_stages=tuning.num_stages)
        return dhidden, None, None, dlogits, None, None, None, None, None


# Not traced by torch.compile (Triton launches in a loop over scratch chunks): a clean graph break, no host sync.
@torch.compiler.disable
def grouped_candidate_log_probs(hidden: torch.Tensor, weight: torch.Tensor, cand: torch.Tensor, group: int,
                                bias: torch.Tensor | None = None, inv_temperature: float | None = None,
                                precision: str | None = None, chunk_bytes: int = 1 << 29,
                                tuning: GroupedTuning | None = None) -> torch.Tensor:
    r"""`candidate_log_probs` with each group's distinct LM-head rows read once (gradients for hidden, bias).

    Args:
        hidden: [M, Dm] fp16 / bf16 / fp32, one query per row (Weaver: row-major [anchors * L, Dm]).
        weight: [Vocab, Dm], frozen LM-head rows (must not require grad).
        cand: int [M, Kc]; ids < 0 or >= Vocab are pads (-inf, no gradient). Duplicates are separate entries.
        group: query rows per group, 1 to 128 (Weaver: anchors per group x L).
        bias: [M, Kc] (read as fp32) or None, added after the temperature.  inv_temperature: None (= 1) or a float.
        precision: the union backward's score-gradient x weight dot: "ieee"
            (fp32), "tf32" (fp32 gradients, tf32 dot) or "bf16" (gradients summed in fp32 and rounded to
            bf16 once, then a bf16 dot at the tensor cores' full rate, as the backward of a bf16 linear
            layer does; needs a bf16 weight and 16-bit hidden); for fp32 hidden also the forward's dot.
            Default: "ieee" for fp32 hidden (as exact as the gather kernels), "bf16" for 16-bit hidden
            with a bf16 weight, else "tf32". The forward's 16-bit products are exact in every mode.
        chunk_bytes: bound on the fp32 score scratch (groups are processed in chunks).
        tuning: launch parameters. Default: `GroupedTuning.for_shape(M, Kc, Dm, group)`.
    Returns:
        logprobs: fp32 [M, Kc].
    """
    if weight.requires_grad:
        raise ValueError("grouped_candidate_log_probs treats weight as frozen, but weight.requires_grad is True")
    if not 1 <= group <= 128:
        raise ValueError(f"group must be 1..128 query rows, got {group}")
    if hidden.dim() != 2 or cand.dim() != 2 or cand.shape[0] != hidden.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [M, Dm], weight [V, Dm], cand [M, Kc], got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(cand.shape)}")
    if bias is not None and bias.shape != cand.shape:
        raise ValueError(f"expected bias of cand's shape {tuple(cand.shape)}, got {tuple(bias.shape)}")
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    precision = precision or ("ieee" if hidden.dtype == torch.float32 else
                              "bf16" if weight.dtype == torch.bfloat16 else "tf32")
    if precision not in ("ieee", "tf32", "bf16") or (precision == "bf16" and (
            weight.dtype != torch.bfloat16 or hidden.dtype == torch.float32)):
        raise ValueError(f"precision must be 'ieee', 'tf32' or 'bf16' (bf16 needs a bf16 weight and 16-bit "
                         f"hidden), got {precision!r} with {hidden.dtype} hidden and a {weight.dtype} weight")
    tuning = GroupedTuning.for_shape(cand.shape[0], cand.shape[1], hidden.shape[1], group) if tuning is None else tuning
    if not isinstance(tuning, GroupedTuning):
        raise TypeError(f"tuning must be a GroupedTuning, got {type(tuning).__name__}")
    return _GroupedCandidateLogProbs.apply(hidden, weight, cand, bias, inv_temperature, group, precision,
                                           chunk_bytes, tuning)
