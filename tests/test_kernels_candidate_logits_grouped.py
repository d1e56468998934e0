"""Grouped candidate log-probs (each group's distinct LM-head rows read once) against float64 autograd."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from candidate_inputs import grads, inputs  # noqa: E402
from kernels.candidate_logits import candidate_logits_ref  # noqa: E402
from kernels.candidate_logits.grouped import group_union, grouped_candidate_log_probs  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests run under TRITON_INTERPRET=1")
gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA device")


@cpu_only
@pytest.mark.parametrize(("M", "Kc", "Dm", "V", "group", "dtype", "inv_t", "pad", "chunk"), [
    (1, 1, 16, 20, 1, torch.float32, None, 0.0, 1 << 29),
    (37, 9, 24, 50, 5, torch.float32, 0.7, 0.2, 1 << 29),     # M not a multiple of the group; pads
    (30, 12, 40, 15, 15, torch.float16, None, 0.1, 1 << 29),  # V < Kc: many duplicates, in rows and groups
    (45, 7, 70, 300, 16, torch.float32, 1.3, 0.0, 4096),      # Dm over one block; chunks of one group
    (20, 40, 32, 400, 20, torch.float32, None, 0.05, 1 << 29),  # union over one BU block
])
def test_grouped_matches_float64(M, Kc, Dm, V, group, dtype, inv_t, pad, chunk):
    hidden, weight, cand, bias, w = inputs(M, Kc, Dm, V, dtype, pad, out_of_range_frac=pad / 2)

    def ours(h, wt, c, b, inv_t):
        return grouped_candidate_log_probs(h, wt, c, group, bias=b, inv_temperature=inv_t, precision="ieee",
                                           chunk_bytes=chunk)

    def ref(h, wt, c, b, inv_t):
        return candidate_logits_ref(h, wt, c, inv_t, b)[1]
    lp, dh, db = grads(ours, hidden, weight, cand, bias, w, dtype, inv_t)
    lp_r, dh_r, db_r = grads(ref, hidden, weight, cand, bias, w, torch.float64, inv_t)
    assert torch.equal(torch.isfinite(lp), torch.isfinite(lp_r))
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    fin = torch.isfinite(lp_r)
    assert (lp.double()[fin] - lp_r[fin]).abs().max() < tol
    assert dh.dtype == dtype
    assert (dh.double() - dh_r).abs().max() <= tol * max(1.0, dh_r.abs().max().item())
    assert (db.double() - db_r).abs().max() <= tol
    assert torch.all(db[~fin] == 0), "pads get no gradient"


@cpu_only
def test_group_union_indexes_every_candidate():
    gen = torch.Generator().manual_seed(3)
    cand = torch.randint(-2, 12, (11, 6), generator=gen)
    union, pos = group_union(cand, 4, 10)
    assert union.shape[0] == 3
    for m in range(11):
        g = m // 4
        members = {int(x) for x in cand[g * 4:(g + 1) * 4].flatten() if 0 <= x < 10}
        assert {int(x) for x in union[g] if x >= 0} == members
        for c in range(6):
            if 0 <= cand[m, c] < 10:
                assert union[g, pos[m, c]] == cand[m, c]
            else:
                assert pos[m, c] == -1


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


@gpu_only
def test_gpu_bf16_training_shape_matches_the_gather_kernel():
    """8 rows x 15 depths x 512 candidates per group, hidden 5120, bf16: same as `candidate_log_probs`."""
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
def test_weaver_score_grouped_matches_gather():
    """Weaver.score with candidate_group_rows (training's score_group_rows) against the gather kernels."""
    from tfm_runtime.models.weaver import Weaver, WeaverConfig
    cfg = WeaverConfig(d_model=256, d_embed=256, d_rank=64, num_layers=1, num_heads=2, mlp_dim=128, lookahead=3,
                       candidate_pool=32)
    torch.manual_seed(0)
    w = Weaver(cfg).cuda()
    with torch.no_grad():
        w.lm_head_query_in.weight.normal_(0, 0.05)
    head = torch.randn(300, 256, device="cuda") / 16
    h = torch.randn(10, 3, 64, device="cuda")
    cand = torch.randint(0, 300, (10, 3, 32), device="cuda")
    logits = torch.randn(10, 3, 32, device="cuda")
    gather = w.score(h, cand, logits, head)
    w.candidate_group_rows = 4
    grouped = w.score(h, cand, logits, head)
    assert (grouped - gather).abs().max() < 1e-3                      # tf32 dots against fp32 gathers
