"""Candidate logits ("top-K projection"): LM-head rows of the candidates only, then log-softmax.

Kernel 1, one program per (row m, block of BLOCK_K candidates): gather whole weight rows (coalesced
along Dm), multiply by the hidden row in fp32 and reduce once after the Dm loop. When a row fits in
one block it also does the log-softmax; otherwise a small per-row kernel does it from the logits.
Memory bound: it reads M*Kc*Dm + M*Dm input elements and writes 2*M*Kc floats.
"""
import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _tile_logits(acc, i_m, o_k, m_k, valid, bias, inv_t, logits, s_bm, Kc, inv_t_scalar,
                 HAS_BIAS: tl.constexpr, INV_T_PER_ROW: tl.constexpr):
    """Reduce a [BK, BD] product tile to the BK logits of row i_m, scale, add the bias, store; returns them."""
    b_l = tl.sum(acc, 1)
    if INV_T_PER_ROW:
        b_l = b_l * tl.load(inv_t + i_m).to(tl.float32)
    else:
        b_l = b_l * inv_t_scalar
    if HAS_BIAS:
        b_l += tl.load(bias + i_m * s_bm + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_l = tl.where(valid, b_l, float("-inf"))
    tl.store(logits + i_m * Kc + o_k, b_l, mask=m_k)
    return b_l


@triton.jit
def candidate_logits_fwd_kernel(
    hidden, weight, cand, bias, inv_t, logits, logprobs, lse,
    s_hm, s_wv, s_cm, s_bm, Kc, Dm, V, inv_t_scalar,
    HAS_BIAS: tl.constexpr, INV_T_PER_ROW: tl.constexpr, FUSED: tl.constexpr, STORE_LSE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr = False,
):
    """PREFETCH: the next hidden block's loads are issued before this block's products (two tiles in
    registers), so a program keeps twice the bytes in flight (its loads are not staged through shared memory)."""
    i_m, i_k = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_k = o_k < Kc
    ids = tl.load(cand + i_m * s_cm + o_k, mask=m_k, other=-1).to(tl.int64)
    valid = m_k & (ids >= 0) & (ids < V)
    p_w = weight + tl.where(valid, ids, 0)[:, None] * s_wv  # [BK, 1] row starts
    acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    if PREFETCH:
        o_d = tl.arange(0, BLOCK_D)
        n_h = tl.load(hidden + i_m * s_hm + o_d, mask=o_d < Dm, other=0.0)                     # [BD]
        n_w = tl.load(p_w + o_d[None, :], mask=valid[:, None] & (o_d < Dm)[None, :], other=0.0)  # [BK, BD]
        for d0 in range(0, Dm, BLOCK_D):
            b_h, b_w = n_h, n_w
            o_d = d0 + BLOCK_D + tl.arange(0, BLOCK_D)        # the next block (all masked after the last)
            n_h = tl.load(hidden + i_m * s_hm + o_d, mask=o_d < Dm, other=0.0)
            n_w = tl.load(p_w + o_d[None, :], mask=valid[:, None] & (o_d < Dm)[None, :], other=0.0)
            acc += b_w.to(tl.float32) * b_h.to(tl.float32)[None, :]
    else:
        for d0 in range(0, Dm, BLOCK_D):
            o_d = d0 + tl.arange(0, BLOCK_D)
            m_d = o_d < Dm
            b_h = tl.load(hidden + i_m * s_hm + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BD]
            b_w = tl.load(p_w + o_d[None, :], mask=valid[:, None] & m_d[None, :], other=0.0)  # [BK, BD]
            acc += b_w.to(tl.float32) * b_h[None, :]
    b_l = _tile_logits(acc, i_m, o_k, m_k, valid, bias, inv_t, logits, s_bm, Kc, inv_t_scalar,
                       HAS_BIAS, INV_T_PER_ROW)
    if FUSED:
        mx = tl.max(b_l, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        se = tl.sum(tl.exp(b_l - mx), 0)
        b_lse = tl.where(se > 0, mx + tl.log(tl.where(se > 0, se, 1.0)), float("-inf"))
        # An all-pad row has lse = -inf: subtract 0 there (its entries are -inf anyway).
        lse_sub = tl.where(se > 0, b_lse, 0.0)
        tl.store(logprobs + i_m * Kc + o_k, tl.where(valid, b_l - lse_sub, float("-inf")), mask=m_k)
        if STORE_LSE:
            tl.store(lse + i_m, b_lse)


@triton.jit
def candidate_logits_persistent_kernel(
    hidden, weight, cand, bias, inv_t, logits,
    s_hm, s_wv, s_cm, s_bm, Kc, Dm, V, inv_t_scalar, n_tiles, n_kb,
    HAS_BIAS: tl.constexpr, INV_T_PER_ROW: tl.constexpr, FLAT: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The logits pass with a fixed number P of programs: program p takes tiles p, p + P, ... (tile t: row
    t // n_kb, candidates (t % n_kb) * BLOCK_K ...), so all programs do the same work (+-1 tile) and finish
    together instead of a last wave draining alone. FLAT: one loop over (tile, hidden block) steps, so the
    pipeline keeps loading across tile boundaries; else a loop over tiles around the hidden-block loop."""
    pid, P = tl.program_id(0), tl.num_programs(0)
    if FLAT:
        n_d = tl.cdiv(Dm, BLOCK_D)
        acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
        for it in range(0, tl.cdiv(n_tiles - pid, P) * n_d):
            t = pid + (it // n_d) * P
            i_m, o_k = (t // n_kb).to(tl.int64), (t % n_kb) * BLOCK_K + tl.arange(0, BLOCK_K)
            m_k = o_k < Kc
            ids = tl.load(cand + i_m * s_cm + o_k, mask=m_k, other=-1).to(tl.int64)
            valid = m_k & (ids >= 0) & (ids < V)
            o_d = (it % n_d) * BLOCK_D + tl.arange(0, BLOCK_D)
            m_d = o_d < Dm
            b_h = tl.load(hidden + i_m * s_hm + o_d, mask=m_d, other=0.0).to(tl.float32)   # [BD]
            b_w = tl.load(weight + tl.where(valid, ids, 0)[:, None] * s_wv + o_d[None, :],
                          mask=valid[:, None] & m_d[None, :], other=0.0)                # [BK, BD]
            acc += b_w.to(tl.float32) * b_h[None, :]
            if it % n_d == n_d - 1:
                _tile_logits(acc, i_m, o_k, m_k, valid, bias, inv_t, logits, s_bm, Kc, inv_t_scalar,
                             HAS_BIAS, INV_T_PER_ROW)
                acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    else:
        for t in range(pid, n_tiles, P):
            i_m, o_k = (t // n_kb).to(tl.int64), (t % n_kb) * BLOCK_K + tl.arange(0, BLOCK_K)
            m_k = o_k < Kc
            ids = tl.load(cand + i_m * s_cm + o_k, mask=m_k, other=-1).to(tl.int64)
            valid = m_k & (ids >= 0) & (ids < V)
            p_w = weight + tl.where(valid, ids, 0)[:, None] * s_wv
            acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
            for d0 in range(0, Dm, BLOCK_D):
                o_d = d0 + tl.arange(0, BLOCK_D)
                m_d = o_d < Dm
                b_h = tl.load(hidden + i_m * s_hm + o_d, mask=m_d, other=0.0).to(tl.float32)
                b_w = tl.load(p_w + o_d[None, :], mask=valid[:, None] & m_d[None, :], other=0.0)
                acc += b_w.to(tl.float32) * b_h[None, :]
            _tile_logits(acc, i_m, o_k, m_k, valid, bias, inv_t, logits, s_bm, Kc, inv_t_scalar,
                         HAS_BIAS, INV_T_PER_ROW)


@triton.jit
def candidate_logits_rows_kernel(
    hidden, weight, cand, bias, inv_t, logits, logprobs, lse, part, counter,
    s_hm, s_wv, s_cm, s_bm, Kc, Dm, V, inv_t_scalar, n_kb, T,
    HAS_BIAS: tl.constexpr, INV_T_PER_ROW: tl.constexpr, STORE_LSE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One launch, log-softmax included. Grid (S, M): program (s, m) scores candidate blocks s*T .. s*T+T-1 of
    row m (one loop over (block, hidden block) steps), keeps a running max and sum of exps of its logits and
    stores them to part [M, S, 2]; then it counts itself in counter[m] (acq_rel). The row's last program
    merges the S partials into the row's lse, writes its log-probs and sets counter[m] back to 0."""
    i_s, i_m = tl.program_id(0), tl.program_id(1).to(tl.int64)
    S = tl.num_programs(0)
    kb0 = i_s * T
    n_d = tl.cdiv(Dm, BLOCK_D)
    acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    run_m = tl.full([], float("-inf"), dtype=tl.float32)
    run_s = tl.zeros([], dtype=tl.float32)
    for it in range(0, tl.minimum(T, n_kb - kb0) * n_d):
        o_k = (kb0 + it // n_d) * BLOCK_K + tl.arange(0, BLOCK_K)
        m_k = o_k < Kc
        ids = tl.load(cand + i_m * s_cm + o_k, mask=m_k, other=-1).to(tl.int64)
        valid = m_k & (ids >= 0) & (ids < V)
        o_d = (it % n_d) * BLOCK_D + tl.arange(0, BLOCK_D)
        m_d = o_d < Dm
        b_h = tl.load(hidden + i_m * s_hm + o_d, mask=m_d, other=0.0).to(tl.float32)       # [BD]
        b_w = tl.load(weight + tl.where(valid, ids, 0)[:, None] * s_wv + o_d[None, :],
                      mask=valid[:, None] & m_d[None, :], other=0.0)                    # [BK, BD]
        acc += b_w.to(tl.float32) * b_h[None, :]
        if it % n_d == n_d - 1:
            b_l = _tile_logits(acc, i_m, o_k, m_k, valid, bias, inv_t, logits, s_bm, Kc, inv_t_scalar,
                               HAS_BIAS, INV_T_PER_ROW)
            new_m = tl.maximum(run_m, tl.max(b_l, 0))
            use_m = tl.where(new_m == float("-inf"), 0.0, new_m)
            run_s = run_s * tl.exp(run_m - use_m) + tl.sum(tl.exp(b_l - use_m), 0)
            run_m = new_m
            acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    tl.store(part + (i_m * S + i_s) * 2, run_m)
    tl.store(part + (i_m * S + i_s) * 2 + 1, run_s)
    if tl.atomic_add(counter + i_m, 1, sem="acq_rel") == S - 1:
        o_s = tl.arange(0, BLOCK_S)
        p_m = tl.load(part + (i_m * S + o_s) * 2, mask=o_s < S, other=float("-inf"), cache_modifier=".cg")
        p_s = tl.load(part + (i_m * S + o_s) * 2 + 1, mask=o_s < S, other=0.0, cache_modifier=".cg")
        mx = tl.max(p_m, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        se = tl.sum(p_s * tl.exp(p_m - mx), 0)
        b_lse = tl.where(se > 0, mx + tl.log(tl.where(se > 0, se, 1.0)), float("-inf"))
        lse_sub = tl.where(se > 0, b_lse, 0.0)
        for c0 in range(0, Kc, BLOCK_C):
            o_c = c0 + tl.arange(0, BLOCK_C)
            m_c = o_c < Kc
            ids = tl.load(cand + i_m * s_cm + o_c, mask=m_c, other=-1)
            b_l = tl.load(logits + i_m * Kc + o_c, mask=m_c, other=float("-inf"), cache_modifier=".cg")
            ok = (ids >= 0) & (ids < V)
            tl.store(logprobs + i_m * Kc + o_c, tl.where(ok, b_l - lse_sub, float("-inf")), mask=m_c)
        if STORE_LSE:
            tl.store(lse + i_m, b_lse)
        tl.store(counter + i_m, 0)


@triton.jit
def candidate_log_softmax_kernel(
    logits, cand, logprobs, lse, s_cm, Kc, V, BLOCK_C: tl.constexpr, STORE_LSE: tl.constexpr,
):
    # One program per row; per-lane online max / sum, reduced across lanes at the end.
    i_m = tl.program_id(0).to(tl.int64)
    m_v = tl.full([BLOCK_C], float("-inf"), dtype=tl.float32)
    s_v = tl.zeros([BLOCK_C], dtype=tl.float32)
    for c0 in range(0, Kc, BLOCK_C):
        o_c = c0 + tl.arange(0, BLOCK_C)
        b_l = tl.load(logits + i_m * Kc + o_c, mask=o_c < Kc, other=float("-inf"))
        m_new = tl.maximum(m_v, b_l)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_v = s_v * tl.exp(m_v - m_use) + tl.exp(b_l - m_use)
        m_v = m_new
    mx = tl.max(m_v, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    se = tl.sum(s_v * tl.exp(m_v - mx), 0)
    b_lse = tl.where(se > 0, mx + tl.log(tl.where(se > 0, se, 1.0)), float("-inf"))
    lse_sub = tl.where(se > 0, b_lse, 0.0)
    for c0 in range(0, Kc, BLOCK_C):
        o_c = c0 + tl.arange(0, BLOCK_C)
        m_c = o_c < Kc
        ids = tl.load(cand + i_m * s_cm + o_c, mask=m_c, other=-1)
        b_l = tl.load(logits + i_m * Kc + o_c, mask=m_c, other=float("-inf"))
        valid = (ids >= 0) & (ids < V)
        tl.store(logprobs + i_m * Kc + o_c, tl.where(valid, b_l - lse_sub, float("-inf")), mask=m_c)
    if STORE_LSE:
        tl.store(lse + i_m, b_lse)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_COUNTERS: dict = {}


def _row_counters(M: int, device: torch.device) -> torch.Tensor:
    """int32 [>= M] zeros for `candidate_logits_rows_kernel`, one buffer per (device, stream), reused: the
    kernel leaves it all zero again. Calls on one stream never overlap, so they can share it."""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < M:
        buf = _COUNTERS[key] = torch.zeros(max(M, 1024), dtype=torch.int32, device=device)
    return buf


def persistent_programs(n_tiles: int, cap: int) -> int:
    """Programs of the persistent logits pass: the largest P <= cap that splits n_tiles evenly, if one
    keeps 3/4 of cap busy; else cap (some programs then take one tile more)."""
    cap = max(1, min(cap, n_tiles))
    for p in range(cap, (3 * cap) // 4, -1):
        if n_tiles % p == 0:
            return p
    return cap


def pick_config(M, Kc, Dm, device):
    """BLOCK_K: 4 up to 256 query rows, above that the largest of 32/16/8 that still gives ~4 programs per SM (else
    4); tiles of <= 8K elements. H200 sweep at Kc=512, hidden 5120 (benchmarks/results/candidate_logits_h200.json):
    4 rows x 2048 columns was fastest at M=1 and 256 (1.136x of the 4.8 TB/s floor vs 1.183x for 32 x 256) and
    within 0.4% at M=65; above 256 rows (training shapes) it is untimed."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
    block_k = 4
    for bk in (32, 16, 8):
        if M > 256 and M * triton.cdiv(Kc, bk) >= 4 * sms:
            block_k = bk
            break
    block_k = max(2, min(block_k, triton.next_power_of_2(Kc)))
    block_d = min(8192 // block_k, max(16, triton.next_power_of_2(Dm)))
    return dict(BLOCK_K=block_k, BLOCK_D=block_d, num_warps=4, num_stages=3)


def candidate_logits_fwd(hidden, weight, cand, inv_temperature, bias, return_lse, cfg):
    M, Dm = hidden.shape
    Kc, V, dev = cand.shape[1], weight.shape[0], hidden.device
    logits = torch.empty(M, Kc, dtype=torch.float32, device=dev)
    logprobs = torch.empty(M, Kc, dtype=torch.float32, device=dev)
    lse = torch.empty(M, dtype=torch.float32, device=dev) if return_lse else None
    if M == 0:
        return (logits, logprobs, lse) if return_lse else (logits, logprobs)
    per_row = isinstance(inv_temperature, torch.Tensor)
    n_kb = triton.cdiv(Kc, cfg["BLOCK_K"])
    common = (hidden.stride(0), weight.stride(0), cand.stride(0), bias.stride(0) if bias is not None else 0,
              Kc, Dm, V, 1.0 if per_row or inv_temperature is None else float(inv_temperature))
    launch = dict(BLOCK_K=cfg["BLOCK_K"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"], HAS_BIAS=bias is not None, INV_T_PER_ROW=per_row)
    inv_t = inv_temperature if per_row else None
    if cfg.get("ROWS", 0) and n_kb > 1:
        sms = _num_sms(dev.index or 0) if dev.type == "cuda" else 4
        T = triton.cdiv(n_kb, max(1, min(n_kb, round(cfg["ROWS"] * sms / M))))
        S = triton.cdiv(n_kb, T)
        part = torch.empty(M, S, 2, dtype=torch.float32, device=dev)
        counter = _row_counters(M, dev) if cfg.get("COUNTER", "cached") == "cached" else \
            torch.zeros(M, dtype=torch.int32, device=dev)
        candidate_logits_rows_kernel[(S, M)](
            hidden, weight, cand, bias, inv_t, logits, logprobs, lse, part, counter, *common, n_kb, T,
            STORE_LSE=return_lse, BLOCK_S=triton.next_power_of_2(S), BLOCK_C=min(1024, triton.next_power_of_2(Kc)),
            **launch)
        return (logits, logprobs, lse) if return_lse else (logits, logprobs)
    if cfg.get("PERSIST", 0) and n_kb > 1:
        sms = _num_sms(dev.index or 0) if dev.type == "cuda" else 4
        P = persistent_programs(M * n_kb, cfg["PERSIST"] * sms)
        candidate_logits_persistent_kernel[(P,)](
            hidden, weight, cand, bias, inv_t, logits, *common, M * n_kb, n_kb, FLAT=cfg.get("FLAT", False), **launch)
    else:
        candidate_logits_fwd_kernel[(M, n_kb)](
            hidden, weight, cand, bias, inv_t, logits, logprobs, lse, *common,
            FUSED=n_kb == 1, STORE_LSE=return_lse, PREFETCH=cfg.get("PREFETCH", False), **launch)
    if n_kb > 1:
        candidate_log_softmax_kernel[(M,)](
            logits, cand, logprobs, lse, cand.stride(0), Kc, V,
            BLOCK_C=min(1024, triton.next_power_of_2(Kc)), STORE_LSE=return_lse, num_warps=4,
        )
    return (logits, logprobs, lse) if return_lse else (logits, logprobs)


def candidate_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    cand: torch.Tensor,
    inv_temperature: float | torch.Tensor | None = None,
    return_lse: bool = False,
    bias: torch.Tensor | None = None,
):
    r"""LM-head logits of a few candidate tokens per row, and their log-softmax over those candidates.

    `logits[m, c] = (hidden[m] . weight[cand[m, c]]) * inv_temperature[m] + bias[m, c]` with fp32
    accumulation, then `logprobs = logits - logsumexp_{valid c}(logits)`. This is a log-softmax over
    the candidates only, not the full-vocabulary log-prob. Duplicate ids are separate entries: each
    copy gets the same logit and every copy counts in the normaliser (dedup before calling if that
    is not wanted). No host sync (CUDA-graph safe).

    Args:
        hidden: [M, Dm], one query vector per row (e.g. per tree node). fp16 / bf16 / fp32.
        weight: [Vocab, Dm], LM-head rows (row-major, last dim contiguous), any float dtype.
        cand: int32 / int64 [M, Kc], candidate ids; negative ids (-1) are padding, and so are ids
            >= Vocab (never read).
        inv_temperature: None (= 1), a float, or an fp32 tensor [M]. Multiplies h.w, not `bias`.
        return_lse: also return the per-row log-sum-exp.
        bias: fp32 [M, Kc] or None, added to the scaled logits before the log-softmax (Weaver:
            DFlash logits + the target-head residual).
    Returns:
        logits: fp32 [M, Kc] (-inf at pads); logprobs: fp32 [M, Kc] (-inf at pads; an all-pad row
        is all -inf); lse: fp32 [M] (-inf for an all-pad row), only if `return_lse`.

    Example::

        >>> lg, lp = candidate_logits(h, lm_head.weight, topk_ids, bias=dflash_logits)
    """
    if hidden.dim() != 2 or weight.dim() != 2 or cand.dim() != 2:
        raise ValueError(f"hidden, weight, cand must be 2-D, got {hidden.dim()}, {weight.dim()}, {cand.dim()}")
    M, Dm = hidden.shape
    if weight.shape[1] != Dm or cand.shape[0] != M:
        raise ValueError(f"expected weight [Vocab, {Dm}] and cand [{M}, Kc], got "
                         f"{tuple(weight.shape)} and {tuple(cand.shape)}")
    if cand.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cand must be int32 or int64, got {cand.dtype}")
    if cand.shape[1] == 0:
        raise ValueError("cand must have at least one column (Kc >= 1)")
    if bias is not None and tuple(bias.shape) != tuple(cand.shape):
        raise ValueError(f"bias must be [M, Kc] = {tuple(cand.shape)}, got {tuple(bias.shape)}")
    if isinstance(inv_temperature, torch.Tensor):
        if tuple(inv_temperature.shape) != (M,):
            raise ValueError(f"a tensor inv_temperature must be [M] = [{M}], got {tuple(inv_temperature.shape)}")
        inv_temperature = inv_temperature.to(torch.float32).contiguous()
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    cand = cand if cand.stride(-1) == 1 else cand.contiguous()
    if bias is not None:
        bias = bias.to(torch.float32)
        bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    cfg = pick_config(M, cand.shape[1], Dm, hidden.device)
    return candidate_logits_fwd(hidden, weight, cand, inv_temperature, bias, return_lse, cfg)
