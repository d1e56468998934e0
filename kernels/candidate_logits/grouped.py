"""Candidate log-probs with LM-head rows shared across a group of query rows (training, experimental).

`candidate_log_probs` gathers weight[cand[m, c]] once per (query m, candidate c): M*Kc*Dm elements each way.
Real candidate sets overlap: a Weaver row's 15 depths, and neighbouring rows, propose many of the same tokens
(benchmarks/results/candidate_overlap_smollm2.json: 8 rows x 15 depths name 23% distinct tokens). Here the
queries are cut into groups of G consecutive rows; each group's distinct candidate ids (its union, U of them)
are read once and scored against all G queries with a tensor-core dot:

    S[g, q, u]      = hidden[g G + q] . weight[union[g, u]]                   (`grouped_scores_kernel`)
    logits[m, c]    = S[m // G, m % G, pos[m, c]] * inv_t + bias[m, c]        (pos: index of cand[m, c] in the union)
    logprobs        = log_softmax over the valid candidates of each row, as `candidate_log_probs`
    dS[g, q, u]     = inv_t * sum_{c: pos[m, c] = u} dlogits[m, c]
    dhidden[g G + q] = sum_u dS[g, q, u] weight[union[g, u]]                  (`grouped_hidden_grad_kernel`)

Weight traffic per pass: NG*U*Dm instead of M*Kc*Dm; the price is a dense fp32 [G, U] score (and gradient)
scratch per group, 4*G*U bytes, processed in chunks of groups. H200 timings: benchmarks/bench_grouped_scoring.py
and the README.
"""
import torch
import triton
import triton.language as tl

from .grad import candidate_hidden_grad


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
                               DOT_PREC: tl.constexpr, IDS_AHEAD: tl.constexpr):
    """dhidden[g G + q, d-block] = sum_u dscores[g, q, u] weight[union[g, u], d-block].

    dscores fp32 (an fp32 dot of `DOT_PREC`) or of the weight's 16-bit dtype (a 16-bit dot, fp32 sums).

    Grid (cdiv(Dm, BD), groups): a group's programs run next to each other and share its dscores
    through L2. dscores [groups, GQ, U]; count int32 [groups] (union entries in use; the loop stops there);
    dhidden [M, Dm]. IDS_AHEAD: the next block's union ids are read before this block's weight rows, so the
    rows' addresses do not wait on a load in the same step.
    """
    i_d, i_g = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_q = tl.arange(0, GQ)
    rows = i_g * G + o_q
    m_q = (o_q < G) & (rows < M)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < Dm
    acc = tl.zeros([GQ, BD], dtype=tl.float32)
    if IDS_AHEAD:
        ids_next = tl.load(union + i_g * U + tl.arange(0, BU), mask=tl.arange(0, BU) < U, other=-1)
    for u0 in range(0, tl.load(count + i_g), BU):
        o_u = u0 + tl.arange(0, BU)
        if IDS_AHEAD:
            ids = ids_next
            ids_next = tl.load(union + i_g * U + o_u + BU, mask=o_u + BU < U, other=-1)
        else:
            ids = tl.load(union + i_g * U + o_u, mask=o_u < U, other=-1)
        valid = (ids >= 0) & (ids < V)
        b_w = tl.load(weight + tl.where(valid, ids, 0)[:, None] * s_wv + o_d[None, :],
                      mask=valid[:, None] & m_d[None, :], other=0.)                     # [BU, BD]
        b_s = tl.load(dscores + (i_g * GQ + o_q[:, None]) * U + o_u[None, :],
                      mask=(o_u < U)[None, :], other=0.)                                # [GQ, BU]
        if dscores.dtype.element_ty == tl.float32:
            acc += tl.dot(b_s, b_w.to(tl.float32), input_precision=DOT_PREC)
        else:
            acc += tl.dot(b_s, b_w)
    tl.store(dhidden + rows[:, None] * Dm + o_d[None, :], acc.to(dhidden.dtype.element_ty),
             mask=m_q[:, None] & m_d[None, :])


@triton.jit
def union_scores_grad_kernel(dlogits, order, local, offs, count, dscores, Kc, U, inv_t, G: tl.constexpr,
                             GQ: tl.constexpr, BU: tl.constexpr, BE: tl.constexpr, DOT_PREC: tl.constexpr):
    """dscores[g, q, u-block] = inv_t * sum of dlogits[g G + q, c] over the candidates c at union index u.

    Grid (cdiv(U, BU), groups of this chunk). Reads the candidates sorted by (group, union index) from
    `group_union(..., entries=True)` (order, local [M * Kc]; offs [groups, U + 1]; count [groups]), so a block's
    candidates are one contiguous range, summed into the [GQ, BU] tile by a dot of one-hot tiles ([GQ, BE] of
    values by row, [BE, BU] of ones by union index): no atomics, and no zeroed dense scratch (every block below
    count is written whole, zeros included; blocks from count on are never read). dlogits fp32 [M, Kc] (0 at
    pads); dscores [groups, GQ, U] fp32 or bf16. The pointers are offset to the chunk's first group, except
    order, local and dlogits (global: offs holds global sorted positions).
    """
    i_u, i_g = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n_u = tl.load(count + i_g)
    u0 = i_u * BU
    if u0 >= n_u:
        return
    lo = tl.load(offs + i_g * (U + 1) + u0)
    hi = tl.load(offs + i_g * (U + 1) + tl.minimum(u0 + BU, n_u))
    o_q, o_u, o_e = tl.arange(0, GQ), tl.arange(0, BU), tl.arange(0, BE)
    acc = tl.zeros([GQ, BU], dtype=tl.float32)
    for e0 in range(lo, hi, BE):
        e = e0 + o_e
        m_e = e < hi
        src = tl.load(order + e, mask=m_e, other=0)                                   # m * Kc + c
        u = tl.load(local + e, mask=m_e, other=-1) - u0
        val = tl.load(dlogits + src, mask=m_e, other=0.)
        q = src // Kc - lo // (G * Kc) * G                                            # row in the group
        b_q = tl.where(o_q[:, None] == q[None, :], val[None, :], 0.)                 # [GQ, BE]
        b_u = tl.where(u[:, None] == o_u[None, :], 1., 0.)                           # [BE, BU]
        acc += tl.dot(b_q, b_u, input_precision=DOT_PREC)
    tl.store(dscores + (i_g * GQ + o_q[:, None]) * U + u0 + o_u[None, :],
             (acc * inv_t).to(dscores.dtype.element_ty), mask=(u0 + o_u < U)[None, :])


def group_union(cand: torch.Tensor, group: int, vocab: int, entries: bool = False) -> tuple[torch.Tensor, ...]:
    """Distinct candidate ids of each group of `group` consecutive rows, without a host sync.

    cand int [M, Kc] (ids < 0 or >= vocab are pads) -> union int64 [ceil(M / group), U] with U = min(group, M) * Kc,
    the most a group can hold (its sorted distinct ids first, then -1; a group with pads also lists one -1 among
    them), pos int64 [M, Kc] (index of cand[m, c] in its group's union, -1 at pads) and count int32 [groups]
    (entries in use per group). One sort of all (group, id) keys; every size is known on the host beforehand, so
    a training step can run ahead of the GPU (and be captured).

    entries: also the candidates sorted by (group, union index), for `union_scores_grad_kernel`: order int64
    [M * Kc] (flat index m * Kc + c of each sorted candidate; group g's are sorted positions g * group * Kc ..),
    local int32 [M * Kc] (its union index) and offs int32 [groups, U + 1] (sorted position of the first candidate
    of each union index; the group's end from count on).
    """
    M, Kc = cand.shape
    NG, U = triton.cdiv(M, group), min(group, M) * Kc
    valid = (cand >= 0) & (cand < vocab)
    g_of_row = torch.arange(M, device=cand.device) // group
    key = (g_of_row[:, None] * (vocab + 1) + torch.where(valid, cand.long(), vocab)).flatten()
    if NG * (vocab + 1) < 2 ** 31:
        key = key.int()                                        # a radix sort over half the key bits
    sk, perm = torch.sort(key)
    # group g's keys are exactly sorted positions g * group * Kc .. (its rows all come before the next group's)
    first = torch.ones_like(sk, dtype=torch.bool)
    first[1:] = sk[1:] != sk[:-1]
    uid = torch.cumsum(first, 0) - 1                           # distinct-key index of each sorted key
    starts = torch.arange(NG, device=cand.device) * (group * Kc)
    ends = torch.clamp(starts + group * Kc, max=M * Kc) - 1
    base = uid[starts]                                         # [NG] first distinct index of each group
    count = (uid[ends] - base + 1).to(torch.int32)
    sk = sk.long()
    ug, ut = sk // (vocab + 1), sk % (vocab + 1)
    local = uid - base[ug]                                     # index in the group's union
    flat = torch.full((NG * U + 1,), -1, dtype=torch.long, device=cand.device)
    # one write per distinct key; repeats go to a spare last entry that is cut off
    flat[torch.where(first, ug * U + local, NG * U)] = torch.where(ut < vocab, ut, -1)
    pos = torch.empty_like(local)
    pos[perm] = local
    pos = torch.where(valid, pos.view(M, Kc), -1)
    if not entries:
        return flat[:NG * U].view(NG, U), pos, count
    offs = (ends + 1).to(torch.int32)[:, None].repeat(1, U + 2).flatten()           # one spare last entry
    where = torch.where(first, ug * (U + 2) + local, NG * (U + 2) - 1)
    offs[where] = torch.arange(M * Kc, device=cand.device, dtype=torch.int32)
    offs = offs.view(NG, U + 2)[:, :U + 1].contiguous()
    return flat[:NG * U].view(NG, U), pos, count, perm, local.to(torch.int32), offs


def _config(U: int, Dm: int, group: int, tuning: dict | None = None) -> dict:
    """Launch parameters: GQ (query rows padded to a power of 2 >= 16), the union and hidden blocks of the
    forward (fwd_bu, fwd_bd) and of the backward (bwd_bu, bwd_bd), warps and pipeline stages, bwd_ids_ahead
    (see `grouped_hidden_grad_kernel`) and bwd_gather: the backward through the per-candidate gather kernel
    (`candidate_hidden_grad`) instead of the union, bwd_gather_tuning: that kernel's own overrides (a dict),
    bwd_builder: the union backward's score gradient built by `union_scores_grad_kernel` from the sorted
    candidates (else a zeroed fp32 scratch, index_put with atomics and a bf16 copy; session 10, not timed yet).
    Default: blocks of up to 64 (128 for the backward's hidden), 8 warps from 64 query rows up, and the gather
    backward. H200, Qwen3.6-27B head, 1024 rows x 15 x 512
    replayed candidates, forward + backward (benchmarks/results/grouped_scoring_h200.json): 4 rows per group
    22.8 ms with the gather backward, 23.9 with the union's (ids ahead; 31.7 without), gather kernels 25.5.
    `tuning` overrides any of them (benchmarks)."""
    GQ = max(16, triton.next_power_of_2(group))
    BU, BD = min(64, max(16, triton.next_power_of_2(U))), min(64, max(16, triton.next_power_of_2(Dm)))
    cfg = dict(GQ=GQ, fwd_bu=BU, fwd_bd=BD, bwd_bu=BU, bwd_bd=min(128, 2 * BD), warps=8 if GQ >= 64 else 4,
               stages=3, bwd_ids_ahead=True, bwd_gather=True, bwd_gather_tuning=None, bwd_builder=True)
    unknown = set(tuning or {}) - (set(cfg) - {"GQ"})
    if unknown:
        raise ValueError(f"unknown tuning keys {sorted(unknown)}; expected some of {sorted(set(cfg) - {'GQ'})}")
    return dict(cfg, **(tuning or {}))


def _dot_prec(precision: str) -> str:
    """`tl.dot` input precision of the fp32 dots: "bf16" mode has none in the backward and 16-bit
    products in the forward, where any setting is exact."""
    return "tf32" if precision == "bf16" else precision


def _scratch_rows(n: int, group: int, GQ: int, device) -> torch.Tensor:
    """[n] row of the flattened [groups, GQ, U] scratch for each of n consecutive query rows."""
    q = torch.arange(n, device=device)
    return (q // group) * GQ + q % group


class _GroupedCandidateLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, cand, bias, inv_t, group, precision, chunk_bytes, tuning):
        M, Kc = cand.shape
        Dm, V = weight.shape[1], weight.shape[0]
        cfg = _config(min(group, M) * Kc, Dm, group, tuning)
        build = not cfg["bwd_gather"] and cfg["bwd_builder"]
        union, pos, count, *sorted_cands = group_union(cand, group, V, entries=build)
        NG, U = union.shape
        GQ = cfg["GQ"]
        chunk = max(1, chunk_bytes // (GQ * U * 4))                          # groups per scratch chunk
        logits = torch.empty(M, Kc, dtype=torch.float32, device=hidden.device)
        for g0 in range(0, NG, chunk):
            g1 = min(NG, g0 + chunk)
            r0, r1 = g0 * group, min(M, g1 * group)
            S = torch.empty(g1 - g0, GQ, U, dtype=torch.float32, device=hidden.device)
            grouped_scores_kernel[(triton.cdiv(U, cfg["fwd_bu"]), g1 - g0)](
                hidden[r0:r1], weight, union[g0:g1], count[g0:g1], S, hidden.stride(0), weight.stride(0), r1 - r0,
                U, Dm, V,
                G=group, GQ=GQ, BU=cfg["fwd_bu"], BD=cfg["fwd_bd"], DOT_PREC=_dot_prec(precision),
                num_warps=cfg["warps"], num_stages=cfg["stages"])
            srow = _scratch_rows(r1 - r0, group, GQ, hidden.device)
            logits[r0:r1] = S.view(-1)[srow[:, None] * U + pos[r0:r1].clamp(min=0)]
        logits = logits * (1.0 if inv_t is None else inv_t)
        if bias is not None:
            logits = logits + bias.float()
        logits = logits.masked_fill(pos < 0, float("-inf"))
        lse = torch.logsumexp(logits, -1, keepdim=True)
        logprobs = torch.where(pos >= 0, logits - torch.where(torch.isfinite(lse), lse, 0.0), float("-inf"))
        ctx.save_for_backward(weight, union, count, pos, logprobs, cand, *sorted_cands)
        ctx.inv_t, ctx.hidden_dtype, ctx.group = inv_t, hidden.dtype, group
        ctx.cfg, ctx.chunk, ctx.precision = cfg, chunk, precision
        return logprobs

    @staticmethod
    def backward(ctx, g):
        weight, union, count, pos, logprobs, cand, *sorted_cands = ctx.saved_tensors
        g = torch.where(pos >= 0, g.float(), 0.0)
        dlogits = g - torch.exp(logprobs) * g.sum(-1, keepdim=True)           # exp(-inf) = 0 at pads
        dhidden = None
        if ctx.needs_input_grad[0] and ctx.cfg["bwd_gather"]:
            inv_t = 1.0 if ctx.inv_t is None else ctx.inv_t
            dhidden = candidate_hidden_grad(dlogits.contiguous(), weight, cand, inv_t, ctx.hidden_dtype,
                                            ctx.cfg["bwd_gather_tuning"])
        elif ctx.needs_input_grad[0]:
            cfg, group, chunk = ctx.cfg, ctx.group, ctx.chunk
            GQ = cfg["GQ"]
            M, Dm, V = pos.shape[0], weight.shape[1], weight.shape[0]
            NG, U = union.shape
            inv_t = 1.0 if ctx.inv_t is None else ctx.inv_t
            dhidden = torch.empty(M, Dm, dtype=ctx.hidden_dtype, device=weight.device)
            for g0 in range(0, NG, chunk):
                g1 = min(NG, g0 + chunk)
                r0, r1 = g0 * group, min(M, g1 * group)
                if sorted_cands:
                    order, local, offs = sorted_cands
                    dS = torch.empty(g1 - g0, GQ, U, device=weight.device,
                                     dtype=torch.bfloat16 if ctx.precision == "bf16" else torch.float32)
                    union_scores_grad_kernel[(triton.cdiv(U, cfg["bwd_bu"]), g1 - g0)](
                        dlogits, order, local, offs[g0:g1], count[g0:g1], dS, pos.shape[1], U, inv_t, G=group,
                        GQ=GQ, BU=cfg["bwd_bu"], BE=32, DOT_PREC="tf32" if ctx.precision == "bf16" else "ieee",
                        num_warps=4)
                else:
                    dS = torch.zeros(g1 - g0, GQ, U, dtype=torch.float32, device=weight.device)
                    srow = _scratch_rows(r1 - r0, group, GQ, weight.device)
                    dS.view(-1, U).index_put_((srow[:, None].expand_as(pos[r0:r1]), pos[r0:r1].clamp(min=0)),
                                              dlogits[r0:r1] * inv_t, accumulate=True)      # 0 at pads
                    if ctx.precision == "bf16":
                        dS = dS.to(torch.bfloat16)                  # summed in fp32, then rounded once
                grouped_hidden_grad_kernel[(triton.cdiv(Dm, cfg["bwd_bd"]), g1 - g0)](
                    dS, weight, union[g0:g1], count[g0:g1], dhidden[r0:r1], weight.stride(0), r1 - r0, U, Dm, V,
                    G=group, GQ=GQ, BU=cfg["bwd_bu"], BD=cfg["bwd_bd"], DOT_PREC=_dot_prec(ctx.precision),
                    IDS_AHEAD=cfg["bwd_ids_ahead"], num_warps=cfg["warps"], num_stages=cfg["stages"])
        dbias = dlogits if ctx.needs_input_grad[3] else None
        return dhidden, None, None, dbias, None, None, None, None, None


# Not traced by torch.compile (Triton launches in a loop over scratch chunks): a clean graph break, no host sync.
@torch.compiler.disable
def grouped_candidate_log_probs(hidden: torch.Tensor, weight: torch.Tensor, cand: torch.Tensor, group: int,
                                bias: torch.Tensor | None = None, inv_temperature: float | None = None,
                                precision: str | None = None, chunk_bytes: int = 1 << 29,
                                tuning: dict | None = None) -> torch.Tensor:
    r"""`candidate_log_probs` with each group's distinct LM-head rows read once (gradients for hidden, bias).

    Args:
        hidden: [M, Dm] fp16 / bf16 / fp32, one query per row (Weaver: row-major [anchors * L, Dm]).
        weight: [Vocab, Dm], frozen LM-head rows (must not require grad).
        cand: int [M, Kc]; ids < 0 or >= Vocab are pads (-inf, no gradient). Duplicates are separate entries.
        group: query rows per group, 1 to 128 (Weaver: anchors per group x L).
        bias: fp32 [M, Kc] or None, added after the temperature.  inv_temperature: None (= 1) or a float.
        precision: the union backward's score-gradient x weight dot (tuning bwd_gather=False): "ieee"
            (fp32), "tf32" (fp32 gradients, tf32 dot) or "bf16" (gradients summed in fp32 and rounded to
            bf16 once, then a bf16 dot at the tensor cores' full rate, as the backward of a bf16 linear
            layer does; needs a bf16 weight and 16-bit hidden); for fp32 hidden also the forward's dot.
            Default: "ieee" for fp32 hidden (as exact as the gather kernels), "bf16" for 16-bit hidden
            with a bf16 weight, else "tf32". The forward's 16-bit products are exact in every mode.
        chunk_bytes: bound on the fp32 score scratch (groups are processed in chunks).
        tuning: launch-parameter overrides (see `_config`; benchmarks).
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
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    precision = precision or ("ieee" if hidden.dtype == torch.float32 else
                              "bf16" if weight.dtype == torch.bfloat16 else "tf32")
    if precision not in ("ieee", "tf32", "bf16") or (precision == "bf16" and (
            weight.dtype != torch.bfloat16 or hidden.dtype == torch.float32)):
        raise ValueError(f"precision must be 'ieee', 'tf32' or 'bf16' (bf16 needs a bf16 weight and 16-bit "
                         f"hidden), got {precision!r} with {hidden.dtype} hidden and a {weight.dtype} weight")
    return _GroupedCandidateLogProbs.apply(hidden, weight, cand, bias, inv_temperature, group, precision,
                                           chunk_bytes, tuning)
