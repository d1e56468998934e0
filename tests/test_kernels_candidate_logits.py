"""Candidate logits + candidate log-softmax (Triton) against the float64 reference."""
import math

import pytest
import torch

from tfm_kernels.candidate_logits import candidate_logits, candidate_logits_ref
from tfm_kernels.candidate_logits.ref import candidate_logits_full_head
from tfm_kernels.candidate_logits import CandidateTuning

# Logits: relative error; logprobs: absolute error.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-3)}


pytestmark = pytest.mark.usefixtures("poison_empty")   # unwritten outputs are NaN and fail


def make_inputs(M, Kc, Dm, V, dtype, pad_frac=0.0, device="cpu", scale=1.0):
    gen = torch.Generator().manual_seed(M * 7919 + Kc * 31 + Dm)
    hidden = (scale * torch.randn(M, Dm, generator=gen)).to(device=device, dtype=dtype)
    weight = (torch.randn(V, Dm, generator=gen) / math.sqrt(Dm)).to(device=device, dtype=dtype)
    cand = torch.randint(0, V, (M, Kc), generator=gen)
    cand[torch.rand(M, Kc, generator=gen) < pad_frac] = -1
    return hidden, weight, cand.to(device=device, dtype=torch.int32)


def check(out, ref, dtype, atol=None):
    """out, ref: (logits, logprobs[, lse]); same -inf pattern, finite entries within tolerance."""
    rtol, atol = TOL[dtype][0], TOL[dtype][1] if atol is None else atol
    for name, o, r in zip(("logits", "logprobs", "lse"), out, ref):
        assert o.dtype == torch.float32, name
        assert not torch.isnan(o).any(), f"NaN in {name}"
        fin = torch.isfinite(r)
        assert torch.equal(torch.isfinite(o).cpu(), fin.cpu()), f"-inf pattern of {name}"
        if not fin.any():
            continue
        err = (o.double()[fin] - r[fin]).abs().max().item()
        bound = rtol * r[fin].abs().max().item() if name == "logits" else atol
        assert err <= max(bound, 1e-6), f"{name}: max abs err {err:.3g} > {bound:.3g}"


# (M, Kc, Dm, Vocab, dtype): Kc = 1 and non-powers of 2; Dm not a multiple of any block.
CASES = [
    (1, 1, 64, 50, torch.float32),
    (3, 2, 100, 37, torch.float32),
    (2, 7, 48, 300, torch.float16),
    (4, 8, 32, 64, torch.float32),
    (2, 64, 80, 1000, torch.float16),
    (3, 100, 130, 500, torch.float32),
]


@pytest.mark.interpreter
@pytest.mark.parametrize(("M", "Kc", "Dm", "V", "dtype"),
                         [pytest.param(*c, id="M{}-Kc{}-Dm{}-V{}-{}".format(*c)) for c in CASES])
def test_matches_float64_ref(M, Kc, Dm, V, dtype):
    hidden, weight, cand = make_inputs(M, Kc, Dm, V, dtype, pad_frac=0.2)
    out = candidate_logits(hidden, weight, cand, return_lse=True)
    check(out, candidate_logits_ref(hidden, weight, cand), dtype)
    if Kc == 1 and (cand >= 0).all():
        assert (out[1] == 0).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("cfg", [(2, 32, False), (16, 16, False), (128, 64, False), (4, 32, True), (64, 64, True)],
                         ids=["K2-D32", "K16-D16", "K128-D64", "K4-D32-prefetch", "K64-D64-prefetch-fused"])
def test_block_sizes_and_dm_remainder(cfg):
    hidden, weight, cand = make_inputs(5, 37, 75, 200, torch.float32, pad_frac=0.1)
    cand[3] = -1                                                          # an all-pad row
    block_k, block_d, prefetch = cfg
    tuning = CandidateTuning(block_k=block_k, block_d=block_d, num_warps=4, num_stages=1, prefetch=prefetch)
    out = candidate_logits(hidden, weight, cand, return_lse=True, tuning=tuning)
    check(out, candidate_logits_ref(hidden, weight, cand), torch.float32)


@pytest.mark.interpreter
def test_pads_duplicates_and_vocab_edges():
    V = 90
    hidden, weight, _ = make_inputs(4, 6, 40, V, torch.float32)
    cand = torch.tensor([[-1, -1, 5, -1, -1, -1],      # all pad but one
                         [0, V - 1, 3, 3, 3, -1],      # vocab edges, triple duplicate
                         [-1] * 6,                     # all pad
                         [V, 7, -5, 7, 8, 2 * V]], dtype=torch.int32)  # out-of-range ids are pads
    lg, lp, lse = candidate_logits(hidden, weight, cand, return_lse=True)
    check((lg, lp, lse), candidate_logits_ref(hidden, weight, cand), torch.float32)
    assert lp[0, 2] == 0 and torch.isinf(lp[0, [0, 1, 3, 4, 5]]).all()
    assert lg[1, 2] == lg[1, 3] == lg[1, 4]
    # Duplicates are separate entries: every copy counts in the normaliser.
    assert abs(torch.logsumexp(lp[1], 0).item()) < 1e-5
    assert torch.isinf(lg[2]).all() and torch.isinf(lp[2]).all() and lse[2] == -math.inf


@pytest.mark.interpreter
def test_huge_logits_bias_and_temperature():
    hidden, weight, cand = make_inputs(3, 9, 64, 120, torch.float32, scale=1e4)
    bias = torch.randn(3, 9) * 1e3
    for inv_t in (None, 0.7, torch.tensor([1.0, 0.5, 2.0])):
        out = candidate_logits(hidden, weight, cand, inv_t, return_lse=True, bias=bias)
        ref = candidate_logits_ref(hidden, weight, cand, inv_t, bias)
        assert out[0].abs().max() > 1e3
        assert torch.isfinite(out[1]).all()
        # fp32 rounding of ~1e4 logits is ~1e-3 absolute; what matters here is no overflow / NaN.
        check(out, ref, torch.float32, atol=1e-6 * ref[0].abs().max().item())


@pytest.mark.interpreter
def test_full_head_cross_check_and_int64_ids():
    hidden, weight, cand = make_inputs(6, 12, 56, 77, torch.float32, pad_frac=0.3)
    lg, lp = candidate_logits(hidden, weight, cand.long())
    full_lg, full_lp = candidate_logits_full_head(hidden.double(), weight.double(), cand)
    fin = torch.isfinite(full_lg)
    assert torch.equal(torch.isfinite(lg), fin)
    assert (lg.double()[fin] - full_lg[fin]).abs().max() < 1e-5
    assert (lp.double()[fin] - full_lp[fin]).abs().max() < 1e-5


def check_rows(device, dtype, M, R, Kc, Dm, V, block_k=None):
    """rows: query m reads candidate row rows[m] of the tables: bit for bit the gathered rows' result."""
    hidden, weight, table = make_inputs(M, R * Kc, Dm, V, dtype, pad_frac=0.1, device=device)
    table = table.view(M, R, Kc)[0].contiguous()                                           # [R, Kc]
    g = torch.Generator().manual_seed(R)
    bias = torch.randn(R, Kc, generator=g).to(device)
    rows = torch.randint(0, R, (M,), generator=g).to(device)
    tuning = None if block_k is None else CandidateTuning(block_k, 32, 4, 1, False)
    got = candidate_logits(hidden, weight, table, return_lse=True, bias=bias, rows=rows, tuning=tuning)
    want = candidate_logits(hidden, weight, table[rows], return_lse=True, bias=bias[rows], tuning=tuning)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    check(got, candidate_logits_ref(hidden, weight, table[rows], None, bias[rows]), dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("block_k", [None, 4, 32])                 # one block per row (fused) and several
def test_rows_index_the_candidate_tables(block_k):
    check_rows("cpu", torch.float32, 5, 3, 12, 40, 90, block_k)


@pytest.mark.gpu
def test_gpu_rows_index_the_candidate_tables():
    check_rows("cuda", torch.bfloat16, 16, 15, 512, 576, 49152)


@pytest.mark.interpreter
def test_bad_inputs_raise():
    hidden, weight, cand = make_inputs(2, 3, 16, 10, torch.float32)
    with pytest.raises(ValueError, match="cand"):
        candidate_logits(hidden, weight, cand.float())
    with pytest.raises(ValueError, match="bias"):
        candidate_logits(hidden, weight, cand, bias=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="weight"):
        candidate_logits(hidden, weight[:, :8], cand)
    with pytest.raises(ValueError, match="rows"):
        candidate_logits(hidden, weight, cand, rows=torch.zeros(2, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize(("M", "Kc"), [(1, 512), (65, 512), (4096, 8), (7, 100), (64, 1)])
def test_gpu_bf16(M, Kc):
    hidden, weight, cand = make_inputs(M, Kc, 5120, 32000, torch.bfloat16, pad_frac=0.05, device="cuda")
    bias = torch.randn(M, Kc, device="cuda")
    out = candidate_logits(hidden, weight, cand, 0.8, return_lse=True, bias=bias)
    check(out, candidate_logits_ref(hidden, weight, cand, 0.8, bias), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [(4, 1024, True), (8, 512, True), (4, 2048, False)],
                         ids=["K4-D1024-pf", "K8-D512-pf", "K4-D2048"])
@pytest.mark.parametrize("M", [16, 65])
def test_gpu_bf16_prefetch(cfg, M):
    # hidden 5000 is not a multiple of the blocks: the prefetched block past the end is fully masked
    hidden, weight, cand = make_inputs(M, 512, 5000, 32000, torch.bfloat16, pad_frac=0.05, device="cuda")
    inv_t, bias = 0.5 + torch.rand(M, device="cuda"), torch.randn(M, 512, device="cuda")
    block_k, block_d, prefetch = cfg
    tuning = CandidateTuning(block_k=block_k, block_d=block_d, num_warps=4, num_stages=3, prefetch=prefetch)
    out = candidate_logits(hidden, weight, cand, inv_t, return_lse=True, bias=bias, tuning=tuning)
    check(out, candidate_logits_ref(hidden, weight, cand, inv_t, bias), torch.bfloat16)


def test_default_tuning_prefetches_from_16_rows():
    cpu = torch.device("cpu")
    assert CandidateTuning.for_shape(64, 512, 5120, cpu) == CandidateTuning(block_k=4, block_d=1024, num_warps=4,
                                                                            num_stages=3, prefetch=True)
    assert CandidateTuning.for_shape(1, 512, 5120, cpu) == CandidateTuning(4, 2048, 4, 3, prefetch=False)
    assert not CandidateTuning.for_shape(4096, 8, 5120, cpu).prefetch
    tiny = CandidateTuning.for_shape(16, 1, 100, cpu)
    assert tiny.block_k == 2 and tiny.block_d == 128
    with pytest.raises(ValueError, match="block_d must be a power of 2"):
        CandidateTuning(block_k=4, block_d=1000, num_warps=4, num_stages=3, prefetch=False)
    with pytest.raises(TypeError, match="CandidateTuning"):
        candidate_logits(torch.zeros(2, 16), torch.zeros(5, 16), torch.zeros(2, 3, dtype=torch.int32),
                         tuning={"block_k": 4})
