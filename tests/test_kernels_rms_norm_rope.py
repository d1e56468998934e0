"""RMSNorm and the rotary embeddings of q, k (Triton, forward: the Weaver's fused qkv, and a target's attention layer
with its K/V cache writes) against their float64 references and against the torch ops they stand in for; CPU runs use
the Triton interpreter (fp32, fp16)."""
import pytest
import torch

from tfm_kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_ref, rms_norm_rows
from tfm_kernels.rope import rope_cache, rope_cache_ref, rope_qk, rope_qk_ref
from tfm_runtime.models.common import RMSNorm, apply_rope, rope_cos_sin


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def _rms_case(shape, dtype, device, bias, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    x = (3 * torch.randn(shape, generator=g)).to(device, dtype)
    w = (1 + torch.randn(shape[-1], generator=g)).to(device, dtype)
    b = torch.randn(shape[-1], generator=g).to(device, dtype) if bias else None
    return x, w, b


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(1, 576), (7, 24), (2, 3, 1000), (5, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_rms_norm_matches_float64_and_the_module(shape, bias):
    """D not a power of 2 (576, 24, 1000) and D = 1, one row and leading dims, with and without bias."""
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 2e-3)):
        x, w, b = _rms_case(shape, dtype, "cpu", bias)
        y = rms_norm(x, w, b, eps=1e-6)
        assert y.shape == x.shape and y.dtype == dtype
        assert _rel(y, rms_norm_ref(x, w, b, 1e-6)) < tol
        mod = RMSNorm(shape[-1], 1e-6, bias=bias).to(dtype)
        with torch.no_grad():
            mod.weight.copy_(w)
            if bias:
                mod.bias.copy_(b)
            want = RMSNorm.forward(mod, x)            # the torch path (the module picks the kernel only on CUDA)
        # the same roundings in the same order; only the fp32 sum of squares may differ in its last bit
        torch.testing.assert_close(y, want, rtol=0, atol=2 * torch.finfo(dtype).eps * float(want.abs().max()))
        if dtype == torch.float16:
            assert (y != want).float().mean() < 1e-3


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(1, 576), (3, 5, 24), (2, 1000), (4, 1)])
@pytest.mark.parametrize("one_plus", [False, True])
def test_add_rms_norm_is_the_add_then_the_norm(shape, one_plus):
    """s = x + r as torch rounds it, and y the norm of s bit for bit as `rms_norm` gives it; float64 within rounding."""
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 2e-3)):
        x, w, b = _rms_case(shape, dtype, "cpu", True)
        r = _rms_case(shape, dtype, "cpu", False, seed=1)[0]
        s, y = add_rms_norm(x, r, w, b, eps=1e-6, one_plus=one_plus)
        assert torch.equal(s, x + r) and s.shape == y.shape == x.shape and y.dtype == dtype
        assert torch.equal(y, rms_norm(x + r, w, b, eps=1e-6, one_plus=one_plus))
        assert _rel(y, rms_norm_ref(x + r, w, b, 1e-6, one_plus=one_plus)) < tol
    with pytest.raises(ValueError, match="rms_norm expects residual"):
        add_rms_norm(x, r[..., :-1] if shape[-1] > 1 else r.double(), w)


@pytest.mark.interpreter
def test_rms_norm_reads_strided_views_in_place():
    """The views a fused projection's output is split into: q's heads [T, nh, D] (rows at two strides) and one half
    of [T, 2D] (one stride) give the norm of their contiguous copies bit for bit, residual add included; a layout
    with no last-dim-contiguous rows (transposed) is copied first and is right too."""
    g = torch.Generator().manual_seed(3)
    T, nh, nkv, D = 5, 3, 2, 24
    qkv = torch.randn(T, (nh + 2 * nkv) * D, generator=g)                    # a fused q/k/v projection's output
    w, b = 1 + torch.randn(D, generator=g), torch.randn(D, generator=g)
    q = qkv[:, : nh * D].view(T, nh, D)
    k = qkv[:, nh * D: (nh + nkv) * D].view(T, nkv, D)
    for x in (q, k, qkv[:, : 6 * D].view(T, 3, 2 * D)[:, :, :D], torch.randn(2 * D, T, generator=g).t()[:, :D]):
        for one_plus in (False, True):
            want = rms_norm(x.contiguous(), w, b, 1e-6, one_plus=one_plus)
            assert torch.equal(rms_norm(x, w, b, 1e-6, one_plus=one_plus), want)
            assert _rel(want, rms_norm_ref(x, w, b, 1e-6, one_plus=one_plus)) < 1e-6
        r = torch.randn(x.shape, generator=g)
        s, y = add_rms_norm(x, r, w, None, 1e-6)
        assert torch.equal(s, x + r) and torch.equal(y, rms_norm(x + r, w, None, 1e-6))


@pytest.mark.interpreter
def test_gated_rms_norm_reads_the_gate_in_place(strided_copies):
    """The GDN output norm's gate z [T, HV, dv] as columns of a fused in-projection's output (rows 2 HV dv + 7 apart,
    an offset of 3), also 2-D [T HV, dv] rows at one stride, with x contiguous or a view too: no copy, and the result of
    contiguous copies bit for bit, within rounding of float64."""
    g = torch.Generator().manual_seed(5)
    T, HV, dv = 5, 3, 20
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 2e-3)):
        fused = torch.randn(T, 2 * HV * dv + 7, generator=g).to(dtype)
        w = (1 + torch.randn(dv, generator=g)).to(dtype)
        z = fused[:, 3:3 + HV * dv].view(T, HV, dv)
        o = torch.randn(T, HV, dv, generator=g).to(dtype)
        x_view = fused[:, 3 + HV * dv:3 + 2 * HV * dv].view(T, HV, dv)
        rows = torch.randn(T * HV, 2 * dv, generator=g).to(dtype)
        for x, gate in ((o, z), (x_view, z), (o.view(T * HV, dv), rows[:, 5:5 + dv])):
            want = rms_norm(x.contiguous(), w, None, 1e-6, gate=gate.contiguous())
            del strided_copies[:]
            got = rms_norm(x, w, None, 1e-6, gate=gate)
            assert strided_copies == [] and torch.equal(got, want)
            assert _rel(got, rms_norm_ref(x, w, None, 1e-6, gate=gate)) < tol


@pytest.mark.interpreter
def test_rms_norm_rows_is_the_norm_of_the_looked_up_rows():
    """An embedding lookup and its norm in one launch: `rms_norm_rows(table, index)` equals `rms_norm(table[index])`
    bit for bit (repeated and 2-D indices, with a bias, a table that is a view with rows apart), and bad inputs are
    refused."""
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.float16):
        table = torch.randn(50, 2 * 40, generator=g).to(dtype)[:, :40]              # rows 80 apart
        w, b = (1 + torch.randn(40, generator=g)).to(dtype), torch.randn(40, generator=g).to(dtype)
        index = torch.tensor([[3, 49, 3], [0, 7, 21]])
        y = rms_norm_rows(table, index, w, b, 1e-6)
        assert y.shape == (2, 3, 40) and y.is_contiguous()
        assert torch.equal(y, rms_norm(table[index], w, b, 1e-6))
    with pytest.raises(ValueError, match="rms_norm_rows expects"):
        rms_norm_rows(table, index.float(), w, b)
    with pytest.raises(ValueError, match="rms_norm_rows expects"):
        rms_norm_rows(table[None], index, w, b)


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(1, 576), (3, 5, 24), (2, 1000)])
def test_rms_norm_matches_the_fast_targets_norms(shape, monkeypatch):
    """The dense targets' norm (`fast.dense.rms_norm`, Llama / Qwen3) and Qwen3.5's (`fast.hybrid.rms_norm_1p`, one
    rounding of x / rms * (1 + w); `gated_rms_norm`, the GDN output norm), forced through the kernel as they run on
    CUDA, against their torch ops."""
    import tfm_runtime.fast.dense as dense
    import tfm_runtime.fast.hybrid as hybrid
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 2e-3)):
        x, w, _ = _rms_case(shape, dtype, "cpu", False)
        atol = 2 * torch.finfo(dtype).eps * 8
        want_dense, want_1p = dense.rms_norm(x, w, 1e-6), hybrid.rms_norm_1p(x, w, 1e-6)
        assert _rel(rms_norm(x, w, None, 1e-6, one_plus=True), rms_norm_ref(x, w, None, 1e-6, one_plus=True)) < tol
        monkeypatch.setattr(dense, "inference_kernel_ok", lambda *a: True)
        monkeypatch.setattr(hybrid, "inference_kernel_ok", lambda *a: True)
        got_dense, got_1p = dense.rms_norm(x, w, 1e-6), hybrid.rms_norm_1p(x, w, 1e-6)
        got_gated = hybrid.gated_rms_norm(x, 2 * x.flip(-1), w, 1e-6)
        monkeypatch.undo()
        want_gated = hybrid.gated_rms_norm(x, 2 * x.flip(-1), w, 1e-6)
        assert _rel(got_gated, rms_norm_ref(x, w, None, 1e-6, gate=2 * x.flip(-1))) < tol
        torch.testing.assert_close(got_gated, want_gated, rtol=0, atol=atol * float(want_gated.abs().max()))
        torch.testing.assert_close(got_dense, want_dense, rtol=0, atol=atol * float(want_dense.abs().max()))
        torch.testing.assert_close(got_1p, want_1p, rtol=0, atol=atol * float(want_1p.abs().max()))
        if dtype == torch.float16:                    # the roundings: fp16 outputs equal but where the fp32 sums
            for got, want in ((got_dense, want_dense), (got_1p, want_1p), (got_gated, want_gated)):   # straddle a
                assert (got != want).float().mean() < 1e-3                                         # boundary
                assert (got != want).float().mean() < 1e-3
        assert not torch.equal(got_dense, got_1p)                     # the two modes differ (1 + w)


def _rope_case(B, T, nh, hd, dtype, device, per_row):
    g = torch.Generator().manual_seed(B * 100 + T * 10 + hd)
    qkv = torch.randn(B, T, 3, nh, hd, generator=g).to(device, dtype)
    pos = torch.randint(0, 40, (B, T) if per_row else (T,), generator=g).to(device)
    cos, sin = rope_cos_sin(pos, hd, 1e4, dtype)
    return qkv, cos, sin


@pytest.mark.interpreter
@pytest.mark.parametrize("B,T,nh,hd,per_row", [(1, 4, 4, 64, True), (2, 16, 3, 6, False), (3, 1, 1, 2, True),
                                                (1, 31, 8, 128, False)])
def test_rope_qk_matches_float64_and_apply_rope(B, T, nh, hd, per_row):
    """Odd head counts and tiny head dims (3 x 6, 1 x 2), per-row positions [B, T, hd] and shared ones [T, hd]."""
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 2e-3)):
        qkv, cos, sin = _rope_case(B, T, nh, hd, dtype, "cpu", per_row)
        q, k = rope_qk(qkv, cos, sin)
        assert q.shape == k.shape == (B, nh, T, hd) and q.dtype == dtype and q.is_contiguous()
        q64, k64 = rope_qk_ref(qkv, cos, sin)
        assert _rel(q, q64) < tol and _rel(k, k64) < tol
        x = qkv.permute(2, 0, 3, 1, 4)                                 # [3, B, nh, T, hd] as WeaverBlock.qkv
        assert torch.equal(q, apply_rope(x[0], cos, sin)) and torch.equal(k, apply_rope(x[1], cos, sin))


@pytest.mark.interpreter
@pytest.mark.parametrize("B,T,nh,hd", [(1, 4, 4, 64), (2, 3, 3, 6), (3, 1, 1, 2)])
def test_rope_qk_by_position_into_a_cache(B, T, nh, hd):
    """cos, sin from a table by position and k, v written into the slots of a larger cache (strided views): the
    rotation of the gathered rows, and v the projection's v; the cache around the slots untouched."""
    g = torch.Generator().manual_seed(B + T + hd)
    for dtype in (torch.float32, torch.float16):
        qkv = torch.randn(B, T, 3, nh, hd, generator=g).to(dtype)
        cos_t, sin_t = rope_cos_sin(torch.arange(1, 18), hd, 1e4, dtype)                    # [17, hd] tables
        pos = torch.randint(0, 17, (B, T), generator=g)
        want_q, want_k = rope_qk(qkv, cos_t[pos], sin_t[pos])
        kc, vc = (torch.randn(B, nh, T + 5, hd, generator=g).to(dtype) for _ in range(2))   # slots 2 .. 2+T-1
        k_before, v_before = kc.clone(), vc.clone()
        q, k = rope_qk(qkv, cos_t, sin_t, positions=pos, k_out=kc[:, :, 2:2 + T], v_out=vc[:, :, 2:2 + T])
        assert torch.equal(q, want_q) and torch.equal(k, want_k) and k.data_ptr() == kc[:, :, 2:].data_ptr()
        assert torch.equal(kc[:, :, 2:2 + T], want_k) and torch.equal(vc[:, :, 2:2 + T], qkv[:, :, 2].transpose(1, 2))
        for c, before in ((kc, k_before), (vc, v_before)):
            assert torch.equal(c[:, :, :2], before[:, :, :2]) and torch.equal(c[:, :, 2 + T:], before[:, :, 2 + T:])
        q64, k64 = rope_qk_ref(qkv, cos_t[pos], sin_t[pos])
        assert _rel(q, q64) < (1e-6 if dtype == torch.float32 else 2e-3)
    with pytest.raises(ValueError, match="rope_qk expects positions"):
        rope_qk(qkv, cos_t, sin_t, positions=pos.int())
    with pytest.raises(ValueError, match="rope_qk expects k_out"):
        rope_qk(qkv, cos_t, sin_t, positions=pos, k_out=kc[:, :, :T].transpose(2, 3))


@pytest.mark.interpreter
@pytest.mark.parametrize("T,nq,nk,D,R", [(1, 9, 3, 64, 64), (5, 3, 1, 6, 6), (4, 4, 2, 8, 4), (7, 2, 2, 10, 2)])
def test_rope_cache_matches_float64_and_the_target_ops(T, nq, nk, D, R):
    """A target's attention layer: q, k (views of one projection, GQA head counts, D not a power of 2, partial rotary
    R < D) rotated by position, k and v written to cache slots in any order: the same tensors and caches as
    `tfm_runtime.fast.dense.rotate` and two `index_copy_`, bit for bit, and within rounding of float64; with the
    q / k norms in the launch (both forms), the runtime's norms then rotation to the norms' summation order."""
    from tfm_runtime.fast.dense import rms_norm as norm_plain
    from tfm_runtime.fast.dense import rms_norm_1p, rotate
    g = torch.Generator().manual_seed(T * 100 + D)
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 2e-3)):
        proj = torch.randn(T, (nq + 2 * nk) * D, generator=g).to(dtype)                    # one projection's rows
        q, k, v = (t.view(T, -1, D) for t in proj.split([nq * D, nk * D, nk * D], dim=-1))
        cos, sin = rope_cos_sin(torch.arange(40), R, 1e4, dtype)                             # tables [40, R]
        pos, slots = torch.randint(0, 40, (T,), generator=g), torch.randperm(12, generator=g)[:T]
        caches = [torch.randn(nk, 12, D, generator=g).to(dtype) for _ in range(2)]
        want_k_cache, want_v_cache = (c.clone() for c in caches)
        got_q, got_k = rope_cache(q, k, v, cos, sin, pos, slots, *caches)

        def torch_rope(x):
            return torch.cat([rotate(x[..., :R], cos[pos], sin[pos]), x[..., R:]], dim=-1)
        want_q, want_k = torch_rope(q), torch_rope(k)
        want_k_cache.index_copy_(1, slots, want_k.transpose(0, 1))
        want_v_cache.index_copy_(1, slots, v.transpose(0, 1))
        assert got_q.shape == (T, nq, D) and got_k.shape == (T, nk, D) and got_q.is_contiguous()
        for got, want in ((got_q, want_q), (got_k, want_k), (caches[0], want_k_cache), (caches[1], want_v_cache)):
            assert torch.equal(got, want)
        q64, k64 = rope_cache_ref(q, k, cos, sin, pos)
        assert _rel(got_q, q64) < tol and _rel(got_k, k64) < tol
        kv_only = [torch.zeros_like(c) for c in caches]                                    # keys and values only
        none, k_only = rope_cache(None, k, v, cos, sin, pos, slots, *kv_only)
        assert none is None and torch.equal(k_only, got_k)
        written = torch.zeros(12, dtype=torch.bool)
        written[slots] = True
        for got, want in zip(kv_only, caches):
            assert torch.equal(got[:, written], want[:, written]) and not got[:, ~written].any()
        for one_plus in (False, True):                  # q / k norms in the launch (Qwen3 / Qwen3.5 attention)
            qw, kw = (0.5 + torch.rand(D, generator=g)).to(dtype), (0.5 + torch.rand(D, generator=g)).to(dtype)
            norm = rms_norm_1p if one_plus else norm_plain
            want_q, want_k = torch_rope(norm(q, qw, 1e-6)), torch_rope(norm(k, kw, 1e-6))
            normed = [c.clone() for c in caches]
            got_q, got_k = rope_cache(q, k, v, cos, sin, pos, slots, *normed, q_norm=qw, k_norm=kw, eps=1e-6,
                                      one_plus=one_plus)
            for got, want in ((got_q, want_q), (got_k, want_k)):     # the norms' sums in another order
                torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            assert torch.equal(normed[0][:, slots], got_k.transpose(0, 1))
            q64, k64 = rope_cache_ref(q, k, cos, sin, pos, qw, kw, 1e-6, one_plus)
            assert _rel(got_q, q64) < tol and _rel(got_k, k64) < tol
            k_only = rope_cache(None, k, v, cos, sin, pos, slots, *normed, k_norm=kw, one_plus=one_plus)[1]
            assert torch.equal(k_only, got_k)
    bad = [dict(pos=pos.int()), dict(slots=slots.repeat(2)), dict(k_cache=caches[0][:, :, :-1]),
           dict(cos=cos[:, :R - 1], sin=sin[:, :R - 1]), dict(v=v.double()), dict(q=q.double()),
           dict(q_norm=qw), dict(k_norm=kw), dict(q_norm=qw[:-1], k_norm=kw), dict(q_norm=qw, k_norm=kw.double())]
    for change in bad:
        args = dict(q=q, k=k, v=v, cos=cos, sin=sin, pos=pos, slots=slots, k_cache=caches[0], v_cache=caches[1])
        with pytest.raises(ValueError, match="rope_cache expects"):
            rope_cache(**{**args, **change})


@pytest.mark.interpreter
def test_bad_inputs():
    x, w, b = _rms_case((3, 8), torch.float32, "cpu", True)
    for args in ((x.double(), w.double(), None), (x, w[:4], b), (x, w, b.half()), (x[:, :0], w[:0], None)):
        with pytest.raises(ValueError, match="rms_norm expects"):
            rms_norm(*args)
    with pytest.raises(ValueError, match="rms_norm expects gate"):
        rms_norm(x, w, None, gate=x[:, :4])
    qkv, cos, sin = _rope_case(2, 4, 2, 8, torch.float32, "cpu", True)
    for args in ((qkv[:, :, :2], cos, sin), (qkv[..., :7], cos[..., :7], sin[..., :7]), (qkv, cos[:1], sin),
                 (qkv, cos.half(), sin), (qkv.double(), cos.double(), sin.double())):
        with pytest.raises(ValueError, match="rope_qk expects"):
            rope_qk(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_weaver_shapes(dtype):
    """The Weaver at the Qwen3.6-27B preset (d_rank 1024, 8 heads of 128; d_model 5120) in one tree-build step."""
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    for shape in ((1, 4, 1024), (1, 4, 5120), (64, 31, 1024)):
        x, w, b = _rms_case(shape, dtype, "cuda", True)
        assert _rel(rms_norm(x, w, b), rms_norm_ref(x, w, b)) < tol
    qkv, cos, sin = _rope_case(1, 4, 8, 128, dtype, "cuda", True)
    q, k = rope_qk(qkv, cos, sin)
    q_ref, k_ref = rope_qk_ref(qkv, cos, sin)
    assert _rel(q, q_ref) < tol and _rel(k, k_ref) < tol
    # the module rounds x * cos, rot(x) * sin and their sum; the kernel rounds once: a few units in the last place
    x = qkv.permute(2, 0, 3, 1, 4)
    for got, want in ((q, apply_rope(x[0], cos, sin)), (k, apply_rope(x[1], cos, sin))):
        torch.testing.assert_close(got, want, rtol=0, atol=2 * torch.finfo(dtype).eps * float(want.abs().max()))
