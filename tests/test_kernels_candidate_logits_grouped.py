"""Grouped candidate log-probs (each group's distinct LM-head rows read once) against float64 autograd."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from candidate_inputs import assert_grads_match_float64, grads, inputs  # noqa: E402
from kernels.candidate_logits.grouped import group_union, grouped_candidate_log_probs  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests run under TRITON_INTERPRET=1")
gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA device")


@cpu_only
@pytest.mark.parametrize(("M", "Kc", "Dm", "V", "group", "dtype", "inv_t", "pad", "chunk", "tuning"), [
    (1, 1, 16, 20, 1, torch.float32, None, 0.0, 1 << 29, None),
    (37, 9, 24, 50, 5, torch.float32, 0.7, 0.2, 1 << 29, None),     # M not a multiple of the group; pads
    (30, 12, 40, 15, 15, torch.float16, None, 0.1, 1 << 29, None),  # V < Kc: many duplicates
    (45, 7, 70, 300, 16, torch.float32, 1.3, 0.0, 4096, None),      # Dm over one block; chunks of one group
    (20, 40, 32, 400, 20, torch.float32, None, 0.05, 1 << 29, None),  # union over one BU block
    # other blocks in each pass: the forward's union over 3 blocks of 16, the backward's hidden over 3 of 16
    (20, 9, 40, 400, 7, torch.float32, 0.9, 0.1, 1 << 29, dict(fwd_bu=16, fwd_bd=32, bwd_bu=32, bwd_bd=16,
                                                               bwd_gather=False)),
    # the union backward: the next union block's ids read ahead; pads and a partial last group; many duplicates
    # (summed by the score-gradient builder's one-hot dot); chunks of one group; the index_put scratch instead
    (20, 9, 40, 400, 7, torch.float32, 0.9, 0.1, 1 << 29, dict(bwd_bu=16, bwd_ids_ahead=True, bwd_gather=False)),
    (37, 9, 24, 50, 5, torch.float32, 0.7, 0.2, 1 << 29, dict(bwd_gather=False)),
    (30, 12, 40, 15, 15, torch.float16, None, 0.1, 1 << 29, dict(bwd_gather=False, bwd_bu=16)),
    (45, 7, 70, 300, 16, torch.float32, 1.3, 0.0, 4096, dict(bwd_gather=False)),
    (37, 9, 24, 50, 5, torch.float32, 0.7, 0.2, 1 << 29, dict(bwd_gather=False, bwd_builder=False)),
    # the backward through the gather kernel
    (37, 9, 24, 50, 5, torch.float32, 0.7, 0.2, 1 << 29, dict(bwd_gather=True)),
    (37, 9, 24, 50, 5, torch.float32, 0.7, 0.2, 1 << 29, dict(bwd_gather=True, bwd_gather_tuning=dict(prefetch=True, block_c=4))),
])
def test_grouped_matches_float64(M, Kc, Dm, V, group, dtype, inv_t, pad, chunk, tuning):
    hidden, weight, cand, bias, w = inputs(M, Kc, Dm, V, dtype, pad, out_of_range_frac=pad / 2)

    def ours(h, wt, c, b, inv_t):
        return grouped_candidate_log_probs(h, wt, c, group, bias=b, inv_temperature=inv_t, precision="ieee",
                                           chunk_bytes=chunk, tuning=tuning)

    assert_grads_match_float64(ours, hidden, weight, cand, bias, w, dtype, inv_t)


@cpu_only
def test_group_union_indexes_every_candidate():
    gen = torch.Generator().manual_seed(3)
    cand = torch.randint(-2, 12, (11, 6), generator=gen)
    union, pos, count = group_union(cand, 4, 10)
    assert union.shape == (3, 4 * 6) and union.is_contiguous()
    for m in range(11):
        g = m // 4
        rows = cand[g * 4:(g + 1) * 4].flatten()
        members = {int(x) for x in rows if 0 <= x < 10}
        has_pad = bool(((rows < 0) | (rows >= 10)).any())
        # sorted distinct ids, one -1 for the group's pads, then -1 up to U
        assert int(count[g]) == len(members) + has_pad
        used = [int(x) for x in union[g, :int(count[g])]]
        assert [x for x in used if x >= 0] == sorted(members) and used.count(-1) == has_pad
        assert torch.all(union[g, int(count[g]):] == -1)
        for c in range(6):
            if 0 <= cand[m, c] < 10:
                assert union[g, pos[m, c]] == cand[m, c]
            else:
                assert pos[m, c] == -1
    # the candidates sorted by (group, union index), for the union backward's score-gradient builder
    u2, pos2, count2, order, local, offs = group_union(cand, 4, 10, entries=True)
    assert torch.equal(u2, union) and torch.equal(pos2, pos) and torch.equal(count2, count)
    assert sorted(order.tolist()) == list(range(11 * 6)) and offs.shape == (3, 4 * 6 + 1)
    for g in range(3):
        end = min(11, 4 * (g + 1)) * 6
        assert torch.all(offs[g, int(count[g]):] == end) and int(offs[g, 0]) == g * 4 * 6
        for u in range(int(count[g])):
            lo, hi = int(offs[g, u]), int(offs[g, u + 1])
            assert hi > lo and torch.all(local[lo:hi] == u)
            for src in order[lo:hi].tolist():
                m, c = divmod(src, 6)
                assert m // 4 == g and (pos[m, c] == u if pos[m, c] >= 0 else union[g, u] == -1)


@cpu_only
def test_all_pad_row_and_bad_input():
    hidden, weight, cand, bias, w = inputs(6, 5, 32, 40, torch.float32)
    cand[1] = -1

    def ours(h, wt, c, b, inv_t):
        return grouped_candidate_log_probs(h, wt, c, 3, bias=b, precision="ieee")
    lp, dh, db = grads(ours, hidden, weight, cand, bias, w, torch.float32)
    assert torch.isinf(lp[1]).all() and torch.all(dh[1] == 0) and torch.all(db[1] == 0)
    assert torch.isfinite(dh).all()
    with pytest.raises(ValueError, match="frozen"):
        grouped_candidate_log_probs(hidden, weight.clone().requires_grad_(), cand, 3)
    for bad in (0, 129):
        with pytest.raises(ValueError, match="group must be"):
            grouped_candidate_log_probs(hidden, weight, cand, bad)
    with pytest.raises(ValueError, match="expected hidden"):
        grouped_candidate_log_probs(hidden[:, :8], weight, cand, 3)
    for prec in ("bf16", "fp8"):  # bf16 needs 16-bit hidden and a bf16 weight
        with pytest.raises(ValueError, match="precision must be"):
            grouped_candidate_log_probs(hidden, weight, cand, 3, precision=prec)
    with pytest.raises(ValueError, match="unknown tuning keys"):
        grouped_candidate_log_probs(hidden, weight, cand, 3, tuning={"block": 32})


@gpu_only
def test_gpu_bf16_training_shape_matches_the_gather_kernel():
    """8 rows x 15 depths x 512 candidates per group, hidden 5120, bf16: same as `candidate_log_probs`.
    Default precision "bf16" (the score gradient rounded to bf16 for the backward dot), checked here only:
    the Triton interpreter's bf16 dots are wrong (this Triton's CPU tests would see 1e10 errors)."""
    from kernels.candidate_logits import candidate_log_probs
    hidden, weight, cand, bias, w = inputs(16 * 15, 512, 5120, 32000, torch.bfloat16, 0.01, "cuda")
    lp, dh, db = grads(lambda h, wt, c, b, _: grouped_candidate_log_probs(h, wt, c, 120, bias=b),
                       hidden, weight, cand, bias, w, torch.bfloat16)
    lp_g, dh_g, db_g = grads(lambda h, wt, c, b, _: candidate_log_probs(h, wt, c, bias=b),
                             hidden, weight, cand, bias, w, torch.bfloat16)
    fin = torch.isfinite(lp_g)
    assert torch.equal(fin, torch.isfinite(lp))
    assert (lp[fin] - lp_g[fin]).abs().max() < 1e-3
    assert (dh.float() - dh_g.float()).norm() / dh_g.float().norm() < 1e-2
    assert (db - db_g).abs().max() < 1e-3


@gpu_only
@pytest.mark.parametrize("tuning", [None, dict(bwd_gather=False)])
def test_gpu_forward_and_backward_never_sync(tuning):
    """The union's size is fixed by the shapes (no read-back), so a training step can run ahead of the GPU:
    CUDA's sync debug mode raises on any host sync inside the call and its backward."""
    hidden, weight, cand, bias, w = inputs(4 * 15, 512, 256, 32000, torch.bfloat16, 0.01, "cuda")
    hidden.requires_grad_(True)
    grouped_candidate_log_probs(hidden, weight, cand, 60, bias=bias, tuning=tuning).sum().backward()  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp = grouped_candidate_log_probs(hidden, weight, cand, 60, bias=bias, tuning=tuning)
        (lp.masked_fill(~torch.isfinite(lp), 0) * w).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(hidden.grad).all()
