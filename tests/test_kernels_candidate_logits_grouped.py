"""Grouped candidate log-probs (each group's distinct LM-head rows read once) against float64 autograd."""
import dataclasses

import pytest
import torch

from candidate_inputs import assert_grads_match_float64, grads, inputs
from tfm_kernels.candidate_logits.grouped import GroupedTuning, grouped_candidate_log_probs
from tfm_kernels.candidate_logits.union import group_union


@pytest.mark.interpreter
@pytest.mark.parametrize(("M", "Kc", "Dm", "V", "group", "dtype", "inv_t", "pad", "chunk", "tuning"), [
    (1, 1, 16, 20, 1, torch.float32, None, 0.0, 1 << 29, None),
    (37, 9, 24, 50, 5, torch.float32, 0.7, 0.2, 1 << 29, None),     # M not a multiple of the group; pads
    (30, 12, 40, 15, 15, torch.float16, None, 0.1, 1 << 29, None),  # V < Kc: many duplicates
    (45, 7, 70, 300, 16, torch.float32, 1.3, 0.0, 4096, None),      # Dm over one block; chunks of one group
    (20, 40, 32, 400, 20, torch.float32, None, 0.05, 1 << 29, None),  # union over one BU block
    # other blocks in each pass: the forward's union over 3 blocks of 16, the backward's hidden over 3 of 16
    (20, 9, 40, 400, 7, torch.float32, 0.9, 0.1, 1 << 29, dict(fwd_bu=16, fwd_bd=32, bwd_bu=32, bwd_bd=16)),
    # the union backward over several union blocks (the next block's ids read ahead): pads and a partial last
    # group; many duplicates (summed by the score gradient's atomics); chunks of one group
    (20, 9, 40, 400, 7, torch.float32, 0.9, 0.1, 1 << 29, dict(bwd_bu=16)),
    (30, 12, 40, 15, 15, torch.float16, None, 0.1, 1 << 29, dict(bwd_bu=16)),
])
def test_grouped_matches_float64(M, Kc, Dm, V, group, dtype, inv_t, pad, chunk, tuning):
    hidden, weight, cand, bias, w = inputs(M, Kc, Dm, V, dtype, pad, out_of_range_frac=pad / 2)
    if tuning is not None:
        tuning = dataclasses.replace(GroupedTuning.for_shape(M, Kc, Dm, group), **tuning)

    def ours(h, wt, c, b, inv_t):
        return grouped_candidate_log_probs(h, wt, c, group, bias=b, inv_temperature=inv_t, precision="ieee",
                                           chunk_bytes=chunk, tuning=tuning)

    assert_grads_match_float64(ours, hidden, weight, cand, bias, w, dtype, inv_t)


@pytest.mark.interpreter
@pytest.mark.parametrize(("M", "Kc", "group", "vocab"), [(11, 6, 4, 10), (23, 40, 5, 100), (9, 70, 9, 64), (3, 5, 7, 33)])
def test_group_union_indexes_every_candidate(M, Kc, group, vocab):
    """Ids across several bitmap words, bit 31 of a word, a vocabulary not a multiple of 32, pads on both sides,
    a partial last group, one group holding all rows."""
    gen = torch.Generator().manual_seed(3)
    cand = torch.randint(-2, vocab + 3, (M, Kc), generator=gen)
    cand[0, :3] = torch.tensor([31, 63, min(95, vocab - 1)])
    union, pos, count = group_union(cand, group, vocab)
    NG = -(-M // group)
    assert union.shape == (NG, min(group, M) * Kc) and union.is_contiguous()
    assert pos.shape == (M, Kc) and count.shape == (NG,)
    for g in range(NG):
        rows = cand[g * group:(g + 1) * group].flatten()
        members = sorted({int(x) for x in rows if 0 <= x < vocab})
        assert int(count[g]) == len(members)
        assert union[g, :len(members)].tolist() == members and torch.all(union[g, len(members):] == -1)
    for m in range(M):
        for c in range(Kc):
            if 0 <= cand[m, c] < vocab:
                assert union[m // group, pos[m, c]] == cand[m, c]
            else:
                assert pos[m, c] == -1


@pytest.mark.interpreter
def test_bias_gradient_alone():
    """hidden needs no gradient: the backward is the log-softmax's alone (no LM-head rows are read)."""
    from tfm_kernels.candidate_logits import candidate_logits_ref
    hidden, weight, cand, bias, w = inputs(13, 6, 24, 40, torch.float32, 0.2, out_of_range_frac=0.1)
    b = bias.clone().requires_grad_()
    lp = grouped_candidate_log_probs(hidden, weight, cand, 4, bias=b, precision="ieee")
    (w * lp.masked_fill(~torch.isfinite(lp), 0)).sum().backward()
    b64 = bias.double().requires_grad_()
    lp64 = candidate_logits_ref(hidden.double(), weight.double(), cand, None, b64)[1]
    (w.double() * lp64.masked_fill(~torch.isfinite(lp64), 0)).sum().backward()
    assert torch.equal(torch.isfinite(lp), torch.isfinite(lp64))
    assert (b.grad.double() - b64.grad).abs().max() < 1e-5


@pytest.mark.interpreter
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
    with pytest.raises(ValueError, match="expected bias"):
        grouped_candidate_log_probs(hidden, weight, cand, 3, bias=bias[:, :4])
    for prec in ("bf16", "fp8"):  # bf16 needs 16-bit hidden and a bf16 weight
        with pytest.raises(ValueError, match="precision must be"):
            grouped_candidate_log_probs(hidden, weight, cand, 3, precision=prec)
    with pytest.raises(TypeError, match="GroupedTuning"):
        grouped_candidate_log_probs(hidden, weight, cand, 3, tuning={"bwd_bd": 32})
    with pytest.raises(ValueError, match="bwd_bu must be a power of 2"):
        dataclasses.replace(GroupedTuning.for_shape(6, 5, 32, 3), bwd_bu=24)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [60, 120])
def test_gpu_bf16_training_shape_matches_the_gather_kernel(group):
    """4 or 8 rows x 15 depths x 512 candidates per group (the backward's hidden blocks: 512 and 256 columns),
    hidden 5120, bf16: same as `candidate_log_probs`.
    Default precision "bf16" (the score gradient rounded to bf16 for the backward dot), checked here only:
    the Triton interpreter's bf16 dots are wrong (this Triton's CPU tests would see 1e10 errors)."""
    from tfm_kernels.candidate_logits import candidate_log_probs
    hidden, weight, cand, bias, w = inputs(16 * 15, 512, 5120, 32000, torch.bfloat16, 0.01, "cuda")
    lp, dh, db = grads(lambda h, wt, c, b, _: grouped_candidate_log_probs(h, wt, c, group, bias=b),
                       hidden, weight, cand, bias, w, torch.bfloat16)
    lp_g, dh_g, db_g = grads(lambda h, wt, c, b, _: candidate_log_probs(h, wt, c, bias=b),
                             hidden, weight, cand, bias, w, torch.bfloat16)
    fin = torch.isfinite(lp_g)
    assert torch.equal(fin, torch.isfinite(lp))
    assert (lp[fin] - lp_g[fin]).abs().max() < 1e-3
    assert (dh.float() - dh_g.float()).norm() / dh_g.float().norm() < 1e-2
    assert (db - db_g).abs().max() < 1e-3


@pytest.mark.gpu
def test_gpu_forward_and_backward_never_sync():
    """The union's size is fixed by the shapes (no read-back), so a training step can run ahead of the GPU:
    CUDA's sync debug mode raises on any host sync inside the call and its backward."""
    hidden, weight, cand, bias, w = inputs(4 * 15, 512, 256, 32000, torch.bfloat16, 0.01, "cuda")
    hidden.requires_grad_(True)
    grouped_candidate_log_probs(hidden, weight, cand, 60, bias=bias).sum().backward()  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp = grouped_candidate_log_probs(hidden, weight, cand, 60, bias=bias)
        (lp.masked_fill(~torch.isfinite(lp), 0) * w).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(hidden.grad).all()
