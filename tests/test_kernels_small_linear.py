"""The small fused linear layer (Triton) against its float64 reference on awkward shapes, its roundings against the
torch modules it replaces (identity weights make the GEMM exact, so the norm, swiglu and residual roundings are
compared bit for bit), row independence, and bad input; CPU runs use the Triton interpreter."""
import pytest
import torch

from tfm_kernels.small_linear import (SMALL_M, SMALL_WEIGHT, small_linear, small_linear_fits, small_linear_ref,
                                     small_qkv_rope, small_qkv_rope_ref)
from tfm_kernels.swiglu import silu_mul, swiglu
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
    as torch's, and swiglu as `tfm_kernels.swiglu` (or with `silu_rounded` as `silu_mul`): equal bit for bit in
    fp16 (in fp32 the order of the sum of squares shows in the last bit: `test_matches_float64`)."""
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
    assert torch.equal(small_linear(x, torch.cat([eye, eye]), swiglu=True, silu_rounded=True, **nk), silu_mul(h, h))


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
             dict(x=torch.zeros(8, 3).t(), weight=w), dict(x=x, weight=w, bias=torch.zeros(8)[::2])]
    for case in cases:
        with pytest.raises(ValueError, match="small_linear"):
            small_linear(**case)


def _qkv_inputs(B, T, K, nh, hd, positions, norm, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed + B + 3 * T + 5 * K + 7 * hd)
    x = (3 * torch.randn(B, T, K, generator=gen)).to(device, dtype)
    w = (torch.randn(3 * nh * hd, K, generator=gen) * K ** -0.5).to(device, dtype)
    P = 24 if positions else T
    ang = 6 * torch.rand(P, hd // 2, generator=gen)
    ang = torch.cat([ang, ang], -1)                                            # the half-split convention
    kw = dict(norm_weight=(1 + 0.2 * torch.randn(K, generator=gen)).to(device, dtype) if norm else None,
              norm_bias=(0.1 * torch.randn(K, generator=gen)).to(device, dtype) if norm else None)
    pos = torch.randint(0, P, (B, T), generator=gen).to(device) if positions else None
    return x, w, ang.cos().to(device, dtype), ang.sin().to(device, dtype), pos, kw


def test_which_layers_it_is_for(monkeypatch):
    """small_linear_fits: at most SMALL_M rows (a 65-node tree) and weights of at most SMALL_WEIGHT elements; the
    runtime's small_linear_ok asks it only in CUDA inference (here the device test said yes)."""
    import tfm_runtime.models.common as common
    small, big = torch.zeros(1).expand(3072, 576), torch.zeros(1).expand(SMALL_WEIGHT // 4096 + 1, 4096)
    assert SMALL_M >= 65 and small_linear_fits(65, small, small) and small_linear_fits(SMALL_M)
    assert not small_linear_fits(SMALL_M + 1, small) and not small_linear_fits(1, small, big)
    x = torch.zeros(65, 576)
    assert not common.small_linear_ok(x, 65, (small,))                       # a CPU tensor: no kernel
    monkeypatch.setattr(common, "kernel_device", lambda t: True)
    assert common.small_linear_ok(x, 65, (small,), None)
    assert not common.small_linear_ok(x, 65, (small, big)) and not common.small_linear_ok(x, SMALL_M + 1, (small,))
    assert not common.small_linear_ok(x, 65, (small.double(),))              # one dtype


@pytest.mark.interpreter
@pytest.mark.parametrize("B, T, K, nh, hd", [(1, 1, 16, 1, 16), (2, 5, 70, 3, 40), (1, 17, 64, 4, 64),
                                             (3, 2, 130, 2, 8)])
@pytest.mark.parametrize("positions", [True, False])
def test_qkv_rope_matches_float64(B, T, K, nh, hd, positions):
    """One token and one head, a half-head not a power of 2 (20) or under one 16-column tile (4), rows past one
    16-row block, K over several chunks; rotation by a position table and by token index; with and without the
    norm (with its bias)."""
    for norm in (True, False):
        x, w, cos, sin, pos, kw = _qkv_inputs(B, T, K, nh, hd, positions, norm, torch.float32, "cpu")
        got = small_qkv_rope(x, w, nh, cos, sin, pos, **kw)
        want = small_qkv_rope_ref(x, w, nh, cos, sin, pos, **kw)
        for g, r in zip(got, want):
            assert g.shape == r.shape == (B, nh, T, hd) and g.dtype == torch.float32
            assert float((g.double() - r).abs().max()) <= 1e-5 * float(r.abs().max())


@pytest.mark.interpreter
def test_qkv_rope_writes_k_and_v_into_given_slots():
    """k_out and v_out as the next slots of a static K/V state: written there (and returned), nothing else of the
    state touched; q as without them."""
    B, T, nh, hd = 2, 3, 2, 16
    x, w, cos, sin, pos, kw = _qkv_inputs(B, T, 32, nh, hd, True, True, torch.float32, "cpu")
    state_k, state_v = torch.full((B, nh, 10, hd), 7.0), torch.full((B, nh, 10, hd), 7.0)
    q0, k0, v0 = small_qkv_rope(x, w, nh, cos, sin, pos, **kw)
    q, k, v = small_qkv_rope(x, w, nh, cos, sin, pos, k_out=state_k[:, :, 4:7], v_out=state_v[:, :, 4:7], **kw)
    assert k.data_ptr() == state_k[:, :, 4:7].data_ptr() and v.data_ptr() == state_v[:, :, 4:7].data_ptr()
    assert torch.equal(q, q0) and torch.equal(state_k[:, :, 4:7], k0) and torch.equal(state_v[:, :, 4:7], v0)
    for state in (state_k, state_v):
        assert (state[:, :, :4] == 7).all() and (state[:, :, 7:] == 7).all()


@pytest.mark.interpreter
def test_qkv_rope_bad_input():
    x, w, cos, sin, pos, _ = _qkv_inputs(1, 3, 16, 2, 8, True, False, torch.float32, "cpu")
    cases = [dict(x=x[0]), dict(weight=w[:-6]), dict(num_heads=5), dict(cos=cos[:, :4]), dict(positions=pos[:, :2]),
             dict(positions=pos.int()), dict(x=x.half()), dict(k_out=torch.zeros(1, 2, 3, 4)),
             dict(v_out=torch.zeros(1, 2, 8, 3).transpose(-1, -2)), dict(norm_bias=torch.zeros(16))]
    for case in cases:
        args = {**dict(x=x, weight=w, num_heads=2, cos=cos, sin=sin, positions=pos), **case}
        with pytest.raises(ValueError, match="small_qkv_rope"):
            small_qkv_rope(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_qkv_rope_weaver_shapes(dtype):
    """The Weaver's qkv at its two presets (rank 256 / 4 heads, 1024 / 8 heads), a step of 16 nodes and one node."""
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for K, nh in ((256, 4), (1024, 8)):
        for T in (1, 16):
            x, w, cos, sin, pos, kw = _qkv_inputs(1, T, K, nh, K // nh, True, True, dtype, "cuda")
            for g, r in zip(small_qkv_rope(x, w, nh, cos, sin, pos, **kw),
                            small_qkv_rope_ref(x, w, nh, cos, sin, pos, **kw)):
                assert float((g.double() - r).abs().max()) <= tol * float(r.abs().max()), (K, T)


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


@pytest.mark.interpreter
def test_weaver_linear_takes_the_kernel_in_inference_only(monkeypatch):
    """`tfm_runtime.models.weaver.linear` forced onto its CUDA rule (the interpreter on the CPU): each combination of
    norm / table rows / swiglu / residual gives its module path's values (fp32, to rounding), over at most SMALL_M
    rows; more rows, or gradients wanted, take the modules (no kernel launch)."""
    import tfm_runtime.models.weaver as weaver_mod
    from tfm_kernels import small_linear as kernel_mod
    from tfm_runtime.models.common import RMSNorm
    gen = torch.Generator().manual_seed(4)
    lin, gate_up = torch.nn.Linear(24, 40), torch.nn.Linear(24, 2 * 40)
    norm = RMSNorm(24, 1e-6, bias=True)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(24, generator=gen))
        norm.bias.add_(0.1 * torch.randn(24, generator=gen))
    x, table = torch.randn(2, 5, 24, generator=gen), torch.randn(30, 24, generator=gen)
    index, res = torch.randint(0, 30, (2, 5), generator=gen), torch.randn(2, 5, 40, generator=gen)
    cases = [dict(x=x, lin=lin), dict(x=x, lin=lin, norm=norm, residual=res), dict(x=table, lin=lin, norm=norm,
             index=index), dict(x=x, lin=gate_up, norm=norm, act_swiglu=True, residual=res)]
    with torch.no_grad():
        want = [weaver_mod.linear(**c) for c in cases]                       # the CPU rule: modules
    calls = []
    real = kernel_mod.small_linear
    monkeypatch.setattr(kernel_mod, "small_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    import tfm_runtime.models.common as common                                 # small_linear_ok's device rule
    monkeypatch.setattr(common, "inference_kernel_ok", lambda x, *p: not (torch.is_grad_enabled() and (
        x.requires_grad or any(t is not None and t.requires_grad for t in p))))
    with torch.no_grad():
        got = [weaver_mod.linear(**c) for c in cases]
        assert len(calls) == len(cases)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        weaver_mod.linear(torch.randn(kernel_mod.SMALL_M + 1, 24), lin)         # too many rows: the modules
    y = weaver_mod.linear(x, lin, norm=norm)                                   # gradients wanted: the modules
    assert y.requires_grad and len(calls) == len(cases)
