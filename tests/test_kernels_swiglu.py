"""SwiGLU (Triton) against its float64 reference, and silu_mul (inference, two projections) against the torch ops it
replaces and float64; CPU runs use the Triton interpreter."""
import pytest
import torch

from tfm_kernels.swiglu import silu_mul, swiglu, swiglu_ref


def _check(shape, dtype, device, tol):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=gen)).to(device, dtype).requires_grad_()
    w = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(device)
    y = swiglu(x)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype
    (dx,) = torch.autograd.grad((y.float() * w).sum(), x)
    x64 = x.detach().double().requires_grad_()
    y64 = swiglu_ref(x64)
    (dx64,) = torch.autograd.grad((y64 * w.double()).sum(), x64)
    assert dx.shape == x.shape and dx.dtype == dtype

    def rel(a, b):
        return float((a.detach().double() - b.detach()).norm() / b.detach().norm())
    assert rel(y, y64) < tol and rel(dx, dx64) < tol


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(7, 3000), (2, 3, 10), (1, 2), (33, 2048)])
def test_matches_float64(shape):
    """Rows not a multiple of the 4-row tile, F over one 1024 block and not a power of 2, leading dims, F = 1."""
    _check(shape, torch.float32, "cpu", 1e-6)


@pytest.mark.interpreter
def test_bad_input():
    for bad in (torch.zeros(3, 5), torch.zeros(3, 0), torch.zeros(4, 6, dtype=torch.float64)):
        with pytest.raises(ValueError, match="swiglu expects"):
            swiglu(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_training_shape(dtype):
    """The Weaver MLP at the Qwen3.6-27B preset (mlp 3072), 64 rows x 31 positions."""
    _check((64, 31, 6144), dtype, "cuda", 1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.gpu
def test_gpu_compiles_without_graph_break():
    lin = torch.nn.Linear(64, 2 * 96, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(5, 31, 64, device="cuda", dtype=torch.bfloat16)

    def f(x):
        return (swiglu(lin(x)).float() ** 2).sum()
    eager = torch.autograd.grad(f(x), lin.weight)[0]
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True)(x), lin.weight)[0]
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)


def check_silu_mul(shape, dtype, device):
    """fp16 / bf16: the torch ops' roundings (silu rounded to the dtype, then the product), within one unit in the
    last place of theirs (the fp32 silu before its rounding may differ in its last bits: another exp). fp32: within
    (|g| + 4) eps of the exact product, elementwise: the GPU's exp is exp2 of the rounded g log2(e), whose relative
    error grows with |g| (torch's expf reduces its argument first: within 2 eps here). And within rounding of
    float64."""
    gen = torch.Generator().manual_seed(sum(shape))
    g, u = (3 * torch.randn(2, *shape, generator=gen)).to(device, dtype)
    y = silu_mul(g, u)
    assert y.shape == g.shape and y.dtype == dtype
    fi = torch.finfo(dtype)
    if dtype == torch.float32:
        exact = torch.nn.functional.silu(g.double()) * u.double()
        assert ((y.double() - exact).abs() <= (g.double().abs() + 4) * fi.eps * exact.abs() + fi.tiny).all()
    else:
        want = (torch.nn.functional.silu(g) * u).double()
        spacing = fi.eps * torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=fi.tiny))))    # one ulp of want
        assert ((y.double() - want).abs() <= spacing).all()
        assert (y.double() == want).double().mean() > 0.99   # equal but where the fp32 silu sits on a boundary
    ref = swiglu_ref(torch.cat([g, u], -1))
    assert float((y.double() - ref).abs().max()) <= 4 * fi.eps * float(ref.abs().max())


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(7, 3000), (2, 3, 10), (1, 1), (5, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_rounds_as_torch(shape, dtype):
    check_silu_mul(shape, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_silu_mul_rounds_as_torch(dtype):
    check_silu_mul((65, 1536), dtype, "cuda")


@pytest.mark.interpreter
def test_silu_mul_reads_the_halves_of_a_fused_projection_in_place():
    """gate and up as the two halves of one [..., 2F] output (rows 2F apart), and a transposed layout (copied), give
    `silu_mul` of their contiguous copies bit for bit."""
    gen = torch.Generator().manual_seed(5)
    for gu in (torch.randn(7, 2 * 300, generator=gen), torch.randn(2, 3, 2 * 10, generator=gen),
               torch.randn(2 * 40, 9, generator=gen).t()):
        F = gu.shape[-1] // 2
        g, u = gu[..., :F], gu[..., F:]
        y = silu_mul(g, u)
        assert y.is_contiguous() and torch.equal(y, silu_mul(g.contiguous(), u.contiguous()))
        assert float((y.double() - swiglu_ref(gu)).abs().max()) <= 4 * torch.finfo(torch.float32).eps * float(
            y.abs().max())


@pytest.mark.interpreter
def test_silu_mul_bad_input():
    for g, u in ((torch.zeros(3, 5), torch.zeros(3, 4)), (torch.zeros(2, 2).double(), torch.zeros(2, 2).double()),
                 (torch.zeros(2, 2), torch.zeros(2, 2).half())):
        with pytest.raises(ValueError, match="silu_mul expects"):
            silu_mul(g, u)
