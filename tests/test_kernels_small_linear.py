"""The small fused linear layer (Triton) against its float64 reference on awkward shapes, its roundings against the
torch modules it replaces (identity weights make the GEMM exact, so the norm, swiglu and residual roundings are
compared bit for bit), row independence, and bad input; CPU runs use the Triton interpreter."""
import pytest
import torch

from tfm_kernels.small_linear import small_linear, small_linear_ref
from tfm_kernels.swiglu import swiglu
from tfm_runtime.models.common import RMSNorm

OPTIONS = {
    "plain": {},
    "bias": dict(bias=True),
    "norm": dict(norm=True),
    "norm_bias_swiglu": dict(norm=True, norm_bias=True, bias=True, swiglu=True),
    "residual": dict(bias=True, residual=True),
    "all": dict(norm=True, norm_bias=True, bias=True, swiglu=True, residual=True),
    "rows_of_a_table": dict(index=True, norm=True, norm_bias=True, bias=True),
}


def _inputs(M, K, N, opts, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed + sum(M) * 7 + K * 3 + N)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)
    N_w = 2 * N if opts.get("swiglu") else N
    kw = dict(bias=rnd(N_w) if opts.get("bias") else None, swiglu=bool(opts.get("swiglu")),
              norm_weight=(1 + rnd(K, scale=0.2)) if opts.get("norm") else None,
              norm_bias=rnd(K, scale=0.1) if opts.get("norm_bias") else None,
              residual=rnd(*M, N) if opts.get("residual") else None)
    if opts.get("index"):
        x = rnd(13, K, scale=3.0)
        kw["index"] = torch.randint(0, 13, M, generator=gen).to(device)
    else:
        x = rnd(*M, K, scale=3.0)
    return x, rnd(N_w, K, scale=K ** -0.5), kw


@pytest.mark.interpreter
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("M, K, N", [((1,), 16, 16), ((3,), 40, 20), ((2, 9), 130, 33), ((17,), 300, 70)])
def test_matches_float64(name, M, K, N):
    """One row, rows past one 16-row block, leading dims; K and N off the tile sizes, K over several 128 chunks."""
    x, w, kw = _inputs(M, K, N, OPTIONS[name], torch.float32, "cpu")
    y = small_linear(x, w, **kw)
    ref = small_linear_ref(x, w, **kw)
    assert y.shape == ref.shape == (*M, N) and y.dtype == torch.float32 and y.is_contiguous()
    assert float((y.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.interpreter
def test_rounds_as_the_torch_modules():
    """With identity weights the product is exact, so what remains are the prologue's and epilogue's roundings:
    the norm as `RMSNorm` (normalised, rounded, times the weight, rounded, plus the bias, rounded), the residual add
    as torch's, and swiglu as `tfm_kernels.swiglu`: equal bit for bit in fp16 (in fp32 the order of the sum of
    squares shows in the last bit: `test_matches_float64`)."""
    K, gen, dtype = 48, torch.Generator().manual_seed(3), torch.float16
    x = (3 * torch.randn(5, K, generator=gen)).to(dtype)
    norm = RMSNorm(K, 1e-5, bias=True).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(K, generator=gen))
        norm.bias.copy_(0.1 * torch.randn(K, generator=gen))
        h = norm(x)                                                        # the module's roundings (CPU torch ops)
    eye = torch.eye(K, dtype=dtype)
    res = torch.randn(5, K, generator=gen).to(dtype)
    nk = dict(norm_weight=norm.weight.detach(), norm_bias=norm.bias.detach(), eps=1e-5)
    assert torch.equal(small_linear(x, eye, **nk), h)
    assert torch.equal(small_linear(x, eye, residual=res, **nk), res + h)
    assert torch.equal(small_linear(x, torch.cat([eye, eye]), swiglu=True, **nk), swiglu(torch.cat([h, h], -1)))


@pytest.mark.interpreter
def test_rows_do_not_depend_on_the_batch():
    """A row's result is the same alone, within any batch, and at any offset (bit for bit)."""
    x, w, kw = _inputs((37,), 96, 40, OPTIONS["all"], torch.float32, "cpu")
    y = small_linear(x, w, **kw)
    res = kw.pop("residual")
    for rows in (slice(0, 1), slice(5, 6), slice(16, 37), slice(3, 20)):
        assert torch.equal(small_linear(x[rows], w, residual=res[rows], **kw), y[rows])


@pytest.mark.interpreter
def test_reads_strided_rows_in_place():
    """x and the residual as row slices of wider tensors (one row stride) give the result of their copies."""
    gen = torch.Generator().manual_seed(1)
    wide, rwide = torch.randn(6, 100, generator=gen), torch.randn(6, 50, generator=gen)
    w, nw = torch.randn(30, 64, generator=gen), torch.rand(64, generator=gen)
    x, res = wide[:, 10:74], rwide[:, 5:35]
    got = small_linear(x, w, norm_weight=nw, residual=res)
    assert torch.equal(got, small_linear(x.contiguous(), w, norm_weight=nw, residual=res.contiguous()))


@pytest.mark.interpreter
def test_bad_input():
    x, w = torch.zeros(3, 8), torch.zeros(4, 8)
    cases = [dict(x=torch.zeros(3, 5), weight=w), dict(x=x, weight=torch.zeros(3, 8), swiglu=True),
             dict(x=x, weight=w, bias=torch.zeros(5)), dict(x=x, weight=w, norm_weight=torch.zeros(7)),
             dict(x=x, weight=w, norm_bias=torch.zeros(8)), dict(x=x, weight=w, residual=torch.zeros(3, 5)),
             dict(x=x.double(), weight=w.double()), dict(x=x, weight=w.half()),
             dict(x=x, weight=w, index=torch.zeros(2, dtype=torch.int32)),
             dict(x=torch.zeros(2, 3, 8), weight=w, index=torch.zeros(2, dtype=torch.long)),
             dict(x=torch.zeros(8, 3).t(), weight=w)]
    for case in cases:
        with pytest.raises(ValueError, match="small_linear"):
            small_linear(**case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("preset", ["smollm2", "qwen36_27b"])
def test_gpu_weaver_shapes(preset, dtype):
    """The Weaver's layers at its two presets (rank, MLP, the LM-head query's width), 1 and 16 rows."""
    r, mlp, d_model = (256, 768, 576) if preset == "smollm2" else (1024, 3072, 5120)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for M in (1, 16):
        for K, N, opts in ((r, 3 * r, OPTIONS["norm"]), (r, r, OPTIONS["residual"]),
                           (r, mlp, OPTIONS["norm_bias_swiglu"]), (mlp, r, OPTIONS["residual"]),
                           (r, d_model, OPTIONS["norm"]), (d_model, r, OPTIONS["rows_of_a_table"])):
            x, w, kw = _inputs((M,), K, N, opts, dtype, "cuda")
            y, ref = small_linear(x, w, **kw), small_linear_ref(x, w, **kw)
            assert float((y.double() - ref).abs().max()) <= tol * float(ref.abs().max()), (M, K, N, opts)
