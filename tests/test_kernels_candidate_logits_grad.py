"""Differentiable candidate log-probs (Triton forward + row-gather backward) against float64 autograd."""
import pytest
import torch

from candidate_inputs import assert_grads_match_float64, grads, inputs
from tfm_kernels.candidate_logits import candidate_log_probs, candidate_logits_ref


def ours(h, weight, cand, b, inv_t):
    return candidate_log_probs(h, weight, cand, bias=b, inv_temperature=inv_t)


def ref(h, weight, cand, b, inv_t):
    return candidate_logits_ref(h, weight, cand, inv_t, b)[1]


@pytest.mark.interpreter
@pytest.mark.parametrize(("M", "Kc", "Dm", "V", "dtype", "inv_t", "pad"), [
    (1, 1, 16, 20, torch.float32, None, 0.0),
    (3, 7, 100, 50, torch.float32, 0.7, 0.2),       # Dm not a multiple of the block, Kc odd, pads
    (2, 40, 48, 30, torch.float16, None, 0.1),      # Kc over one BLOCK_C, many duplicates (V < Kc)
    (4, 33, 300, 97, torch.float32, 1.3, 0.0),      # Dm over one BLOCK_D
])
def test_grads_match_float64(M, Kc, Dm, V, dtype, inv_t, pad):
    assert_grads_match_float64(ours, *inputs(M, Kc, Dm, V, dtype, pad), dtype, inv_t)


@pytest.mark.interpreter
@pytest.mark.parametrize("tuning", [(2, 64, 2), (4, 128, 4)], ids=["c2", "c4"])
def test_hidden_grad_launch_variants_match_default(tuning):
    from tfm_kernels.candidate_logits.grad import HiddenGradTuning, candidate_hidden_grad
    hidden, weight, cand, bias, w = inputs(5, 37, 300, 80, torch.float32, 0.2)
    dl = torch.randn(cand.shape)
    want = candidate_hidden_grad(dl, weight, cand, 0.5, torch.float32)
    block_c, block_d, warps = tuning
    got = candidate_hidden_grad(dl, weight, cand, 0.5, torch.float32,
                                HiddenGradTuning(block_c=block_c, block_d=block_d, num_warps=warps, num_stages=3))
    ref_ = 0.5 * torch.einsum("mc,mcd->md", dl * (cand >= 0), weight[cand.clamp(min=0)])
    assert (got - ref_).abs().max() < 1e-4 and (want - ref_).abs().max() < 1e-4


@pytest.mark.interpreter
def test_all_pad_row_and_frozen_weight():
    hidden, weight, cand, bias, w = inputs(2, 5, 32, 40, torch.float32)
    cand[1] = -1
    lp, dh, db = grads(ours, hidden, weight, cand, bias, w, torch.float32, None)
    assert torch.isinf(lp[1]).all() and torch.all(dh[1] == 0) and torch.all(db[1] == 0)
    assert torch.isfinite(dh).all()
    with pytest.raises(ValueError, match="frozen"):
        candidate_log_probs(hidden, weight.clone().requires_grad_(), cand)
    with pytest.raises(ValueError, match="float inv_temperature"):
        candidate_log_probs(hidden, weight, cand, inv_temperature=torch.ones(2))


@pytest.mark.gpu
def test_gpu_bf16_training_shape():
    """The Qwen3.6-27B training shape: 15 depths x 512 candidates per row, hidden 5120."""
    hidden, weight, cand, bias, w = inputs(4 * 15, 512, 5120, 32000, torch.bfloat16, 0.01, "cuda")
    lp, dh, db = grads(ours, hidden, weight, cand, bias, w, torch.bfloat16, None)
    lp_r, dh_r, db_r = grads(ref, hidden, weight, cand, bias, w, torch.float64, None)
    fin = torch.isfinite(lp_r)
    assert (lp.double()[fin] - lp_r[fin]).abs().max() < 1e-3           # same bf16 inputs, fp32 accumulation
    rel = (dh.double() - dh_r).norm() / dh_r.norm()
    assert rel < 1e-2, rel
    assert (db.double() - db_r).abs().max() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("group_rows", [0, 2])
def test_weaver_score_cuda_matches_torch_path(group_rows):
    """Weaver.score on CUDA (kernels: gathers, or grouped with `group_rows` rows per group) against the same
    function through weight[cand] + bmm in float64."""
    from tfm_runtime.models.weaver import Weaver, WeaverConfig, WeaverScoring
    cfg = WeaverConfig(d_model=256, d_embed=256, d_rank=64, num_layers=1, num_heads=2, mlp_dim=128, lookahead=3,
                       candidate_pool=32)
    torch.manual_seed(0)
    wv = Weaver(cfg).cuda()
    lm = torch.randn(1000, 256, device="cuda") / 16
    h = torch.randn(5, 3, 64, device="cuda", requires_grad=True)
    cand = torch.randint(0, 1000, (5, 3, 32), device="cuda")
    cl = torch.randn(5, 3, 32, device="cuda")
    lq = wv.score(h, cand, cl, lm, WeaverScoring(group_rows=group_rows))
    (lq * torch.arange(32, device="cuda")).sum().backward()
    g = h.grad.clone()
    h.grad = None
    wv64 = wv.double()
    lq64 = wv64.score(h.double(), cand, cl.double(), lm.double())                      # float64: the torch path
    (lq64 * torch.arange(32, device="cuda")).sum().backward()
    assert (lq.double() - lq64).abs().max() < 1e-4
    assert (g.double() - h.grad).abs().max() < 1e-4 * max(1.0, h.grad.abs().max().item())
