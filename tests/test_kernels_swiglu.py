"""SwiGLU (Triton) against its float64 reference; CPU runs use the Triton interpreter."""
import pytest
import torch

from tfm_kernels.swiglu import swiglu, swiglu_ref


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
