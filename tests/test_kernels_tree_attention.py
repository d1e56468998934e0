"""Tree attention (Triton) against its float64 reference; CPU runs use the Triton interpreter."""
import pytest
import torch

from tfm_kernels.tree_attention import (TreeAttentionTuning, ancestor_bitmask, ancestor_mask, tree_attention,
                                   tree_attention_ref)
from tfm_kernels.tree_utils import check_parents, pack_bits, tree_depth, unpack_bits

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


pytestmark = pytest.mark.usefixtures("poison_empty")   # unwritten outputs are NaN and fail


def rel_rms(ref, out):
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_parents(kind, B, N, num_nodes, gen):
    parent = torch.full((B, N), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(1, int(num_nodes[b])):
            parent[b, i] = {"chain": i - 1, "star": 0}.get(kind, int(torch.randint(0, i, (1,), generator=gen)))
    return parent


def make_inputs(B, N, Hq, Hkv, D, Lmax, dtype, kind="random", num_nodes=None, prefix_len=None, device="cpu"):
    gen = torch.Generator().manual_seed(1000 * N + 10 * Lmax + D)
    num_nodes = torch.full((B,), N) if num_nodes is None else torch.tensor(num_nodes)
    prefix_len = torch.full((B,), Lmax) if prefix_len is None else torch.tensor(prefix_len)
    parent = make_parents(kind, B, N, num_nodes, gen)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return dict(
        q=rnd(B, N, Hq, D), k_tree=rnd(B, N, Hkv, D), v_tree=rnd(B, N, Hkv, D),
        k_prefix=rnd(B, Lmax, Hkv, D), v_prefix=rnd(B, Lmax, Hkv, D),
        prefix_len=prefix_len.to(device=device, dtype=torch.int32),
        anc=ancestor_bitmask(parent, num_nodes).to(device),
        num_nodes=num_nodes.to(device=device, dtype=torch.int32),
    )


def check_against_ref(inp, dtype, **kwargs):
    o, lse = tree_attention(**inp, return_lse=True, **kwargs)
    ref_o, ref_lse = tree_attention_ref(**inp)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert rel_rms(ref_o, o) <= TOL[dtype]
    # Padding rows: lse = -inf in both; elsewhere finite and close.
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(ref_lse.cpu()))
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 20 * TOL[dtype]
    return o, lse


# (B, N, Hq, Hkv, D, Lmax, dtype, kind): awkward sizes, GQA 1/2/8, L = 0/1/non-multiple of 64.
CASES = [
    (2, 7, 4, 2, 32, 150, torch.float32, "random"),
    (1, 9, 8, 1, 16, 64, torch.float16, "star"),
    (2, 5, 2, 2, 24, 1, torch.float32, "random"),
    (1, 6, 4, 2, 16, 0, torch.float32, "random"),
    (1, 40, 2, 1, 16, 33, torch.float16, "random"),
    (1, 70, 1, 1, 16, 5, torch.float32, "random"),
]


@pytest.mark.interpreter
@pytest.mark.parametrize(("B", "N", "Hq", "Hkv", "D", "L", "dtype", "kind"),
                         [pytest.param(*c, id="B{}-N{}-Hq{}-Hkv{}-D{}-L{}-{}-{}".format(*c)) for c in CASES])
def test_matches_float64_ref(B, N, Hq, Hkv, D, L, dtype, kind):
    check_against_ref(make_inputs(B, N, Hq, Hkv, D, L, dtype, kind), dtype)


@pytest.mark.interpreter
def test_padded_nodes_and_requests():
    inp = make_inputs(3, 6, 4, 2, 16, 70, torch.float16, num_nodes=[5, 0, 2], prefix_len=[70, 3, 0])
    o, lse = check_against_ref(inp, torch.float16)
    assert (o[0, 5:] == 0).all() and (o[1] == 0).all() and (o[2, 2:] == 0).all()
    assert torch.isinf(lse[1]).all() and torch.isfinite(lse[0, :5]).all()


@pytest.mark.interpreter
def test_tree_keys_and_values_with_their_own_strides(strided_copies):
    """k_tree contiguous and v_tree a column slice of a wider row (as a fused q, k, v projection leaves it): read in
    place (no copy), the same output as from contiguous copies."""
    inp = make_inputs(2, 7, 4, 2, 16, 40, torch.float32)
    B, N, Hkv, D = inp["v_tree"].shape
    wide = torch.randn(B, N, 3 * Hkv * D + 5)
    wide[..., 5 + Hkv * D: 5 + 2 * Hkv * D] = inp["v_tree"].reshape(B, N, Hkv * D)
    v = wide[..., 5 + Hkv * D: 5 + 2 * Hkv * D].view(B, N, Hkv, D)                # rows 3 Hkv D + 5 apart
    assert v.stride() != inp["k_tree"].stride()
    o_strided, lse = tree_attention(**{**inp, "v_tree": v}, return_lse=True)
    assert strided_copies == []
    torch.testing.assert_close(o_strided, tree_attention(**inp), rtol=0, atol=0)
    check_against_ref({**inp, "v_tree": v}, torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_split_kv_merge_equals_single_pass(num_splits):
    inp = make_inputs(2, 5, 4, 2, 16, 200, torch.float32, prefix_len=[200, 77])
    o, _ = check_against_ref(inp, torch.float32, num_splits=num_splits)
    o1 = tree_attention(**inp, num_splits=1)
    assert rel_rms(o1, o) <= 1e-6


@pytest.mark.interpreter
def test_other_tiles_match_float64_ref():
    """16-row tiles over 5 nodes x 4 q heads (two row tiles), 16 keys per step, 2 splits."""
    inp = make_inputs(2, 5, 4, 1, 16, 70, torch.float32, prefix_len=[70, 21])
    check_against_ref(inp, torch.float32, tuning=TreeAttentionTuning(block_m=16, block_n=16, num_warps=2, num_stages=1,
                                                                     num_splits=2))
    with pytest.raises(ValueError, match="block_n must be a power of 2"):
        TreeAttentionTuning(block_m=16, block_n=24, num_warps=4, num_stages=2)


@pytest.mark.interpreter
def test_chain_equals_causal_attention():
    B, N, Hq, Hkv, D, L = 1, 8, 4, 2, 16, 45
    inp = make_inputs(B, N, Hq, Hkv, D, L, torch.float32, kind="chain")
    o = tree_attention(**inp)
    # Causal extend: query i sits at position L + i and sees keys 0..L+i.
    k = torch.cat([inp["k_prefix"][0], inp["k_tree"][0]]).transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
    v = torch.cat([inp["v_prefix"][0], inp["v_tree"][0]]).transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
    causal = torch.ones(N, L + N, dtype=torch.bool).tril(L)
    ref = torch.nn.functional.scaled_dot_product_attention(
        inp["q"][0].transpose(0, 1).double(), k.double(), v.double(), attn_mask=causal)
    assert rel_rms(ref.transpose(0, 1)[None], o) <= 1e-5


@pytest.mark.interpreter
def test_single_node_equals_decode():
    B, Hq, Hkv, D, L = 2, 8, 2, 32, 90
    inp = make_inputs(B, 1, Hq, Hkv, D, L, torch.float32)
    o = tree_attention(**inp)
    for b in range(B):
        k = torch.cat([inp["k_prefix"][b], inp["k_tree"][b]]).transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        v = torch.cat([inp["v_prefix"][b], inp["v_tree"][b]]).transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        ref = torch.nn.functional.scaled_dot_product_attention(
            inp["q"][b].transpose(0, 1)[:, :, None].double(), k[:, None].double(), v[:, None].double())
        assert rel_rms(ref[:, :, 0].transpose(0, 1), o[b]) <= 1e-5


@pytest.mark.interpreter
def test_mask_encodings_agree():
    inp = make_inputs(2, 9, 4, 2, 16, 20, torch.float32)
    anc_bool = unpack_bits(inp["anc"], 9)
    o_bits = tree_attention(**inp, sm_scale=0.3)
    o_bool = tree_attention(**{**inp, "anc": anc_bool}, sm_scale=0.3)
    words64 = torch.nn.functional.pad(inp["anc"], (0, 1)).view(torch.int64)  # [B, N, 1] int64
    o_64 = tree_attention(**{**inp, "anc": words64}, sm_scale=0.3)
    ref, _ = tree_attention_ref(**inp, sm_scale=0.3)
    assert torch.equal(o_bits, o_bool) and torch.equal(o_bits, o_64)
    assert rel_rms(ref, o_bits) <= 1e-5


def test_tree_utils_against_parent_walk():
    gen = torch.Generator().manual_seed(7)
    for N in (1, 2, 31, 32, 33, 70):
        n = torch.tensor([N, max(1, N // 2)])
        parent = make_parents("random", 2, N, n, gen)
        check_parents(parent, n)
        anc, depth = ancestor_mask(parent, n), tree_depth(parent, n)
        for b in range(2):
            for i in range(N):
                walk, j = set(), i if i < n[b] else -1
                while j >= 0:
                    walk.add(j)
                    j = int(parent[b, j])
                assert set(torch.nonzero(anc[b, i]).flatten().tolist()) == walk
                assert int(depth[b, i]) == max(len(walk) - 1, 0)
        assert torch.equal(unpack_bits(pack_bits(anc), N), anc)
    with pytest.raises(ValueError):
        check_parents(torch.tensor([[-1, 0, 2]]))
    with pytest.raises(ValueError):
        check_parents(torch.tensor([[0, 0, 1]]))


@pytest.mark.interpreter
def test_bad_shapes_raise():
    inp = make_inputs(1, 4, 4, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        tree_attention(**{**inp, "q": torch.randn(1, 4, 3, 16)})
    with pytest.raises(ValueError, match="k_prefix"):
        tree_attention(**{**inp, "k_prefix": torch.randn(1, 8, 1, 16)})
    with pytest.raises(ValueError, match="bitmask"):
        tree_attention(**{**inp, "anc": inp["anc"][:, :3]})


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "chain", "star"])
@pytest.mark.parametrize(("dtype", "L", "N"), [(torch.bfloat16, 4113, 65), (torch.float32, 1000, 16),
                                               (torch.bfloat16, 0, 129), (torch.bfloat16, 300, 1)])
def test_gpu_qwen_shapes(kind, dtype, L, N):
    inp = make_inputs(1, N, 24, 4, 256, L, dtype, kind, device="cuda")
    check_against_ref(inp, dtype)


@pytest.mark.gpu
def test_gpu_padded_batch_and_splits():
    inp = make_inputs(3, 33, 16, 2, 128, 2000, torch.bfloat16, num_nodes=[33, 0, 7],
                      prefix_len=[2000, 5, 1234], device="cuda")
    for s in (None, 1, 7):
        check_against_ref(inp, torch.bfloat16, num_splits=s)
