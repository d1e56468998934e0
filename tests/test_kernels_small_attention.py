"""Small masked attention (Triton, forward + backward) against its float64 reference; CPU runs use the
Triton interpreter in fp32."""
import pytest
import torch

from tfm_kernels.small_attention import small_attention, small_attention_ref
from tfm_kernels.small_attention.triton import small_attention_bwd, small_attention_fwd
from tfm_runtime.models.weaver import chain_mask

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_rms(ref, out):
    assert torch.isfinite(out).all(), "NaN or inf in output"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_mask(kind, T, S, gen, device="cpu"):
    if kind == "chain":
        assert T == S and T % 2 == 1
        return chain_mask(T // 2, device)
    if kind == "causal":
        return torch.ones(T, S, dtype=torch.bool).tril().to(device)
    mask = torch.rand(T, S, generator=gen) > 0.6
    mask[torch.arange(T), torch.randint(0, S, (T,), generator=gen)] = True          # >= 1 visible key per row
    return mask.to(device)


def make_qkv(B, nh, T, S, hd, dtype, layout, gen, device="cpu"):
    """q [B, nh, T, hd], k, v [B, nh, S, hd] leaves. layout "weaver": views of one qkv projection output
    [B, T, 3, nh, hd].permute(2, 0, 3, 1, 4) as in WeaverBlock.qkv (needs T == S); "plain": contiguous."""
    if layout == "weaver":
        assert T == S
        qkv = torch.randn(B, T, 3, nh, hd, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        return (q, k, v), qkv
    q = torch.randn(B, nh, T, hd, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    k = torch.randn(B, nh, S, hd, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    v = torch.randn(B, nh, S, hd, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    return (q, k, v), None


def check_against_ref(qkv, mask, tol):
    """Forward and the gradients of sum(w * o) for a random w, against the float64 reference."""
    q, k, v = qkv
    o = small_attention(q, k, v, mask)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert o.transpose(1, 2).is_contiguous()                                     # [B, T, nh, hd] underneath
    leaves64 = [x.detach().double().requires_grad_() for x in qkv]
    ref = small_attention_ref(*leaves64, mask)
    assert rel_rms(ref, o) <= tol
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(o.device)
    grads = torch.autograd.grad((o * w.to(o.dtype)).sum(), qkv)
    grads64 = torch.autograd.grad((ref * w).sum(), leaves64)
    for name, g, g64 in zip("qkv", grads, grads64):
        assert g.shape == g64.shape, name
        assert rel_rms(g64, g) <= tol, f"d{name}: rel RMS {rel_rms(g64, g):.3g}"
    return o, grads


# (B, nh, T, S, hd, mask kind, layout): the Weaver chain at its real T and hd; padding in every dim.
CASES = [
    (3, 2, 31, 31, 128, "chain", "plain"),
    (2, 3, 5, 9, 24, "random", "plain"),
    (1, 1, 17, 17, 16, "causal", "plain"),
    (2, 2, 7, 7, 40, "chain", "weaver"),
]


@pytest.mark.interpreter
@pytest.mark.usefixtures("poison_empty")                # unwritten outputs are NaN and fail
@pytest.mark.parametrize(("B", "nh", "T", "S", "hd", "kind", "layout"),
                         [pytest.param(*c, id="B{}-nh{}-T{}-S{}-hd{}-{}-{}".format(*c)) for c in CASES])
def test_matches_float64_ref(B, nh, T, S, hd, kind, layout):
    gen = torch.Generator().manual_seed(100 * T + hd)
    qkv, _ = make_qkv(B, nh, T, S, hd, torch.float32, layout, gen)
    mask = make_mask(kind, T, S, gen)
    check_against_ref(qkv, mask[None, None] if layout == "weaver" else mask, TOL[torch.float32])


@pytest.mark.interpreter
def test_weaver_layout_gradient_reaches_qkv():
    gen = torch.Generator().manual_seed(3)
    (q, k, v), qkv = make_qkv(2, 2, 7, 7, 16, torch.float32, "weaver", gen)
    o = small_attention(q, k, v, chain_mask(3))
    (g,) = torch.autograd.grad(o.sum(), qkv)
    leaf = qkv.detach().double().requires_grad_()
    (g64,) = torch.autograd.grad(small_attention_ref(*leaf.permute(2, 0, 3, 1, 4), chain_mask(3)).sum(), leaf)
    assert g.shape == qkv.shape and rel_rms(g64, g) <= TOL[torch.float32]


@pytest.mark.interpreter
@pytest.mark.usefixtures("poison_empty")
def test_fully_masked_row_gives_zeros_and_finite_grads():
    gen = torch.Generator().manual_seed(5)
    qkv, _ = make_qkv(2, 2, 6, 8, 16, torch.float32, "plain", gen)
    mask = make_mask("random", 6, 8, gen)
    mask[2] = False                                                               # row 2 sees nothing
    o, (dq, dk, dv) = check_against_ref(qkv, mask, TOL[torch.float32])
    assert (o[:, :, 2] == 0).all() and (dq[:, :, 2] == 0).all()
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    _, lse = small_attention_fwd(*[x.detach() for x in qkv], mask, 0.25)
    assert torch.isneginf(lse[:, :, 2]).all() and torch.isfinite(lse[:, :, [0, 1, 3, 4, 5]]).all()


@pytest.mark.interpreter
def test_ops_pass_opcheck():
    """Schema, fake (meta) implementations with the real strides, autograd registration, AOT dispatch."""
    gen = torch.Generator().manual_seed(9)
    (q, k, v), _ = make_qkv(2, 3, 5, 5, 24, torch.float32, "weaver", gen)
    mask = make_mask("random", 5, 5, gen)
    torch.library.opcheck(small_attention_fwd, (q, k, v, mask, 0.3))
    q, k, v = (x.detach() for x in (q, k, v))
    _, lse = small_attention_fwd(q, k, v, mask, 0.3)
    do = torch.randn(2, 5, 3, 24, generator=gen)
    torch.library.opcheck(small_attention_bwd, (do, q, k, v, mask, lse, 0.3))


@pytest.mark.interpreter
def test_compiles_without_graph_break():
    gen = torch.Generator().manual_seed(11)
    (q, k, v), qkv = make_qkv(2, 2, 7, 7, 16, torch.float32, "weaver", gen)
    mask = chain_mask(3)

    def fn(qkv):
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        o = small_attention(q * 1.5, k, v, mask[None, None])
        return o.transpose(1, 2).reshape(2, 7, -1).sin().sum()

    # aot_eager: dynamo + AOT autograd (the custom ops, their fakes and autograd formula) without C++ codegen.
    got = torch.autograd.grad(torch.compile(fn, backend="aot_eager", fullgraph=True)(qkv), qkv)[0]
    want = torch.autograd.grad(fn(qkv), qkv)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_inputs_raise():
    q = torch.zeros(2, 2, 5, 16)
    k = v = torch.zeros(2, 2, 7, 16)
    mask = torch.ones(5, 7, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mask must be bool \[T, S\] or \[1, 1, T, S\] = \[5, 7\], got .*2, 1, 5, 7"):
        small_attention(q, k, v, mask.expand(2, 1, 5, 7))
    with pytest.raises(ValueError, match="mask must be bool"):
        small_attention(q, k, v, mask.float())
    with pytest.raises(ValueError, match="one dtype.*torch.float32, torch.bfloat16, torch.float32"):
        small_attention(q, k.bfloat16(), v, mask)
    with pytest.raises(ValueError, match="T, S <= 128.*got T=129"):
        small_attention(torch.zeros(2, 2, 129, 16), k, v, torch.ones(129, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="k, v must be"):
        small_attention(q, k[:, :1], v, mask)


# ---- GPU ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["plain", "weaver"])
def test_bf16_weaver_shape_matches_ref(layout):
    gen = torch.Generator().manual_seed(13)
    qkv, _ = make_qkv(64, 8, 31, 31, 128, torch.bfloat16, layout, gen, device="cuda")
    check_against_ref(qkv, chain_mask(15, "cuda"), TOL[torch.bfloat16])


@pytest.mark.gpu
def test_compiled_step_matches_eager():
    gen = torch.Generator().manual_seed(17)
    (q, k, v), qkv = make_qkv(64, 8, 31, 31, 128, torch.bfloat16, "weaver", gen, device="cuda")
    w = torch.randn(64, 31, 8 * 128, generator=gen).cuda()
    mask = chain_mask(15, "cuda")

    def fn(qkv):
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        o = small_attention(q, k, v, mask[None, None])
        return (o.transpose(1, 2).reshape(64, 31, -1).float() * w).sum()

    compiled = torch.compile(fn, fullgraph=True)                                  # inductor; a graph break raises
    got = torch.autograd.grad(compiled(qkv), qkv)[0]
    want = torch.autograd.grad(fn(qkv), qkv)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_weaver_uses_kernel_on_cuda():
    from tfm_runtime.models.weaver import _small_attention_bmm
    from tfm_runtime.models.weaver import small_attention as weaver_attention
    gen = torch.Generator().manual_seed(19)
    (q, k, v), _ = make_qkv(8, 8, 31, 31, 128, torch.bfloat16, "weaver", gen, device="cuda")
    mask = chain_mask(15, "cuda")[None, None]
    o = weaver_attention(q, k, v, mask)
    assert o.transpose(1, 2).is_contiguous()                                     # the kernel's layout
    ref = small_attention_ref(q, k, v, mask)
    assert rel_rms(ref, o) <= TOL[torch.bfloat16] and rel_rms(ref, _small_attention_bmm(q, k, v, mask)) <= 1e-2
