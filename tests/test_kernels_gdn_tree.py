"""GDN tree verify / commit and the tree short conv (Triton) against their float64 references.

On a machine without CUDA the kernels run under the Triton interpreter (fp32/fp16, tiny shapes).
"""
import dataclasses

import pytest
import torch

from tfm_kernels.gdn_tree import (GDNTuning, check_parents, ref, tree_ancestor_bits, tree_conv1d,
                              tree_conv1d_commit, tree_gdn_commit, tree_gdn_verify)
from tfm_kernels.gdn_tree.verify import root_folded
from tfm_kernels.launch import pdl_supported

pytestmark = pytest.mark.usefixtures("poison_empty")   # unwritten outputs are NaN and fail


def tuned(N, device, **changes):
    """The default tuning for N nodes on `device` with some fields changed."""
    return dataclasses.replace(GDNTuning.for_shape(N, torch.device(device)), **changes)


def rel_rms(out, ref_):
    assert not torch.isnan(out).any(), "NaN in output"
    r = ref_.double().cpu()
    return ((out.double().cpu() - r).norm() / r.norm().clamp_min(1e-30)).item()


def make_batch(B, N, ns, kind, gen, p_chain=0.5):
    parent = torch.full((B, N), -1, dtype=torch.int32)
    for b, n in enumerate(ns):
        parent[b, :n] = ref.make_tree(n, kind, p_chain=p_chain, topk=3, generator=gen).int()
        parent[b, n:] = 7  # garbage in padding must be ignored
    return parent, torch.tensor(ns, dtype=torch.int32)


def make_gdn(B, N, H, HV, K, V, dtype, gen, gnorm=1.0, g_const=None, beta_const=None,
             s0_scale=1.0, prenorm=False):
    q, k = torch.randn(B, N, H, K, generator=gen), torch.randn(B, N, H, K, generator=gen)
    if prenorm:
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, N, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, N, HV, generator=gen)) / gnorm
    beta = torch.rand(B, N, HV, generator=gen)
    if g_const is not None:
        g = torch.full_like(g, g_const)
    if beta_const is not None:
        beta = torch.full_like(beta, beta_const)
    pool = torch.randn(B + 2, HV, K, V, generator=gen) * s0_scale
    sidx = torch.randperm(B + 2, generator=gen)[:B].int()
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta, pool, sidx


# (B, N, num_nodes, H, HV, K, V, kind, dtype, extra)
VERIFY_CASES = [
    (1, 1, [1], 2, 4, 16, 16, "chain", torch.float32, {}),
    (1, 17, [17], 2, 4, 16, 16, "chain", torch.float32, {}),
    (1, 20, [20], 2, 4, 16, 32, "star", torch.float16, {}),
    (1, 31, [31], 2, 4, 32, 16, "binary", torch.float32, {"v_first": True, "block_t": 32}),
    (1, 40, [40], 2, 4, 16, 16, "eagle", torch.float32, {"block_t": 64}),
    (1, 24, [24], 2, 4, 16, 16, "random", torch.float32, {"p_chain": 0.0}),
    (1, 33, [33], 2, 4, 16, 16, "random", torch.float16, {"p_chain": 0.9}),
    (1, 40, [40], 1, 2, 16, 16, "spine", torch.float32, {"block_t": 16, "p_chain": 0.8}),
    (1, 70, [70], 1, 2, 16, 16, "spine", torch.float32, {"p_chain": 0.95, "block_t": 64}),
    # several blocks, and off-diagonal rows over one or several column chunks (N=200 at
    # block_t=32 has 256 padded columns: two chunks of 128)
    (1, 70, [70], 1, 2, 16, 16, "chain", torch.float32, {"block_t": 16}),
    (1, 70, [70], 2, 4, 16, 16, "random", torch.float16, {"block_t": 16, "p_chain": 0.7}),
    (2, 200, [200, 77], 1, 2, 16, 16, "spine", torch.float32, {"block_t": 32, "p_chain": 0.9}),
    (1, 70, [70], 1, 2, 16, 16, "random", torch.float32, {"block_t": 16, "block_c": 64}),
    (2, 200, [200, 150], 1, 2, 16, 16, "random", torch.float32, {"block_t": 32, "block_c": 128}),
    (1, 256, [250], 1, 1, 16, 16, "random", torch.float32, {"block_t": 16, "p_chain": 0.8}),
    # 16-column solve dots, and a prep whose last column chunk is partial
    (2, 100, [100, 61], 1, 2, 16, 16, "spine", torch.float32, {"block_t": 16, "solve_kc": 16}),
    (2, 100, [100, 45], 1, 2, 16, 16, "spine", torch.float32, {"block_t": 32, "block_c": 64}),
    # the prep as two launches (diagonals, then tiles reading back G and the norms)
    (1, 70, [70], 2, 4, 16, 16, "random", torch.float16, {"block_t": 16, "prep_split": True}),
    (2, 200, [200, 77], 1, 2, 16, 16, "spine", torch.float32, {"block_t": 32, "block_c": 64,
                                                               "prep_split": True}),
    (3, 24, [24, 9, 5], 2, 4, 16, 16, "random", torch.float32, {"pad_request": 2, "prep_split": True}),
    (1, 16, [16], 2, 4, 16, 16, "random", torch.float32, {"prenorm": True, "l2norm": False,
                                                          "prep_split": True}),
    # padding nodes full of NaN must not reach real nodes (prep loads are masked by N, not n)
    (2, 40, [40, 23], 2, 4, 16, 16, "random", torch.float32, {"nan_padding": True}),
    (2, 40, [40, 23], 2, 4, 16, 16, "random", torch.float32, {"nan_padding": True, "prep_split": True}),
    (3, 24, [24, 9, 5], 2, 4, 16, 16, "random", torch.float32, {"pad_request": 2}),
    (2, 12, [12, 7], 2, 2, 20, 24, "random", torch.float32, {"v_first": True}),
    (1, 16, [16], 2, 4, 16, 16, "random", torch.float32, {"gnorm": 0.01}),
    (1, 16, [16], 2, 4, 16, 16, "random", torch.float32, {"gnorm": 10.0}),
    (1, 16, [16], 2, 4, 16, 16, "chain", torch.float32, {"g_const": -30.0}),
    (1, 16, [16], 2, 4, 16, 16, "random", torch.float32, {"beta_const": 1e-4}),
    (1, 16, [16], 2, 4, 16, 16, "chain", torch.float32, {"beta_const": 1 - 1e-4}),
    (1, 16, [16], 2, 4, 16, 16, "random", torch.float32, {"s0_scale": 0.0}),
    (1, 16, [16], 2, 4, 16, 16, "random", torch.float16, {"s0_scale": 100.0}),
    (1, 16, [16], 2, 4, 16, 16, "random", torch.float32, {"prenorm": True, "l2norm": False}),
    # node 0 folded into the state (single_root; N = 1 mod block_t): padded requests and nodes,
    # one node, BT = 32, both state layouts, no l2norm, strong decay (e^-G0 of masked rows stays out)
    (1, 17, [17], 2, 4, 16, 16, "chain", torch.float32, {"single_root": True}),
    (1, 33, [33], 2, 4, 16, 16, "random", torch.float16, {"single_root": True, "p_chain": 0.9}),
    (1, 33, [33], 2, 4, 16, 16, "random", torch.float32, {"single_root": False}),
    (2, 65, [65, 40], 2, 4, 16, 16, "eagle", torch.float32, {"single_root": True, "prep_split": True}),
    (3, 33, [33, 9, 1], 2, 4, 16, 16, "random", torch.float32, {"single_root": True, "pad_request": 2}),
    (1, 65, [65], 1, 2, 16, 16, "random", torch.float32, {"single_root": True, "block_t": 32}),
    (2, 49, [49, 23], 2, 4, 16, 16, "random", torch.float32, {"single_root": True, "nan_padding": True}),
    (2, 17, [17, 5], 2, 2, 20, 24, "random", torch.float32, {"single_root": True, "v_first": True}),
    (1, 17, [17], 2, 4, 16, 16, "random", torch.float32, {"single_root": True, "prenorm": True,
                                                          "l2norm": False}),
    (1, 17, [17], 2, 4, 16, 16, "chain", torch.float32, {"single_root": True, "g_const": -30.0}),
    (2, 81, [81, 70], 1, 2, 16, 16, "spine", torch.float32, {"single_root": True, "solve_kc": 16}),
    # diagonal inverses from 4- or 8-node blocks merged by doublings (one, two, three factors)
    (1, 16, [16], 2, 4, 16, 16, "random", torch.float32, {"inv_base": 4}),
    (1, 16, [16], 2, 4, 16, 16, "chain", torch.float32, {"inv_base": 16}),
    (1, 40, [40], 2, 4, 16, 16, "eagle", torch.float16, {"block_t": 32, "inv_base": 8}),
    (1, 70, [70], 1, 2, 16, 16, "random", torch.float32, {"block_t": 64, "inv_base": 4}),
    (2, 65, [65, 40], 2, 4, 16, 16, "eagle", torch.float32, {"single_root": True, "prep_split": True,
                                                            "inv_base": 4}),
    # the default tuning at 65 nodes (2-warp solve, 4-warp prep programs) with the root folded
    (2, 65, [65, 40], 2, 4, 16, 16, "eagle", torch.float32, {"single_root": True}),
]
# the keys of a case's extra that are GDNTuning fields
TUNING_KEYS = {f.name for f in dataclasses.fields(GDNTuning)}


def run_verify(case, dev, seed=0):
    B, N, ns, H, HV, K, V, kind, dtype, extra = case
    gen = torch.Generator().manual_seed(seed)
    parent, num = make_batch(B, N, ns, kind, gen, extra.get("p_chain", 0.5))
    q, k, v, g, beta, pool, sidx = make_gdn(
        B, N, H, HV, K, V, dtype, gen, extra.get("gnorm", 1.0), extra.get("g_const"),
        extra.get("beta_const"), extra.get("s0_scale", 1.0), extra.get("prenorm", False))
    if "pad_request" in extra:
        sidx[extra["pad_request"]] = -1
    if extra.get("nan_padding"):
        for b, n in enumerate(ns):
            for t in (q, k, v, g, beta):
                t[b, n:] = float("nan")
    vf, l2 = extra.get("v_first", False), extra.get("l2norm", True)
    dpool = (pool.transpose(-1, -2) if vf else pool).contiguous().to(dev)
    before = dpool.clone()
    d = [t.to(dev) for t in (q, k, v, g, beta, parent, num, sidx)]
    tuning = tuned(N, dev, **{key: val for key, val in extra.items() if key in TUNING_KEYS})
    o, stash = tree_gdn_verify(*d[:7], dpool, d[7], use_qk_l2norm=l2, state_v_first=vf,
                               precision="ieee", single_root=extra.get("single_root"), tuning=tuning)
    assert torch.equal(dpool, before), "verify wrote the committed state"
    if extra.get("nan_padding"):
        for b, n in enumerate(ns):  # the float64 reference reads nothing past n either
            for t in (q, k, v, g, beta):
                t[b, n:] = 0
    num_eff = torch.where(sidx >= 0, num, 0)
    S0 = pool[sidx.long().clamp(min=0)]
    ro, S, rv, rG = ref.tree_gdn_recurrent(q, k, v, g, beta, parent, num_eff, S0,
                                           use_qk_l2norm=l2)
    return dict(o=o, stash=stash, ro=ro, S=S, rv=rv, rG=rG, pool=pool, dpool=dpool, sidx=sidx,
                parent=parent, num=num_eff, dtype=dtype)


@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: "B{}-N{}-H{}-HV{}-K{}-V{}-{}-{}".format(
    c[0], c[1], c[3], c[4], c[5], c[6], c[7], str(c[8])[6:]) + "".join(
        f"-{a}{b}" for a, b in c[9].items()))
def test_verify_matches_float64(case, kernel_device):
    r = run_verify(case, kernel_device)
    tol = 1e-5 if r["dtype"] == torch.float32 else 2e-3
    for name, out, want in (("o", r["o"], r["ro"]), ("vnew", r["stash"].vnew, r["rv"]),
                            ("G", r["stash"].G, r["rG"])):
        if want.abs().max() == 0:
            assert out.abs().max() == 0, name
        else:
            assert rel_rms(out, want) < tol, name
    for b in range(len(r["num"])):
        n = int(r["num"][b])
        assert not r["o"][b, n:].abs().any() and not r["stash"].vnew[b, n:].abs().any()


@pytest.mark.parametrize("N,extra", [(14, {}), (17, {"single_root": True})])
def test_commit_every_node_and_out_idx(N, extra, kernel_device):
    dev = kernel_device
    case = (2, N, [N, 11], 2, 4, 16, 32, "random", torch.float32, extra)
    r = run_verify(case, dev, seed=3)
    pool, sidx = r["dpool"], r["sidx"].to(dev)
    out_idx = torch.tensor([s for s in range(pool.shape[0]) if s not in r["sidx"].tolist()][:2],
                           dtype=torch.int32, device=dev)
    src = pool[sidx.long()].clone()
    for a in range(N):
        leaf = torch.tensor([a, min(a, 10)], device=dev)
        tree_gdn_commit(pool, sidx, leaf, r["stash"], out_idx=out_idx, precision="ieee")
        assert torch.equal(pool[sidx.long()], src), "commit into out_idx touched the source slot"
        for b in range(2):
            assert rel_rms(pool[out_idx[b].long()], r["S"][b, int(leaf[b])]) < 1e-5, (a, b)
    # in place, and leaf = -1 (nothing accepted) keeps S0
    tree_gdn_commit(pool, sidx, torch.tensor([5, -1], device=dev), r["stash"], precision="ieee")
    assert rel_rms(pool[sidx[0].long()], r["S"][0, 5]) < 1e-5
    assert torch.equal(pool[sidx[1].long()], src[1])


def test_two_step_consistency(kernel_device):
    """verify -> commit leaf -> verify a new tree == one float64 run over the concatenated path."""
    gen = torch.Generator().manual_seed(5)
    H, HV, K, V, n1, n2 = 2, 4, 16, 16, 12, 10
    p1 = ref.make_tree(n1, "random", generator=gen)
    p2 = ref.make_tree(n2, "random", generator=gen)
    q, k, v, g, beta, pool, sidx = make_gdn(1, n1 + n2, H, HV, K, V, torch.float32, gen)
    dev = kernel_device
    dpool = pool.clone().to(dev)
    leaf = n1 - 1
    for sl, par in ((slice(0, n1), p1), (slice(n1, n1 + n2), p2)):
        args = [t[:, sl].contiguous().to(dev) for t in (q, k, v, g, beta)]
        n = par.numel()
        o, stash = tree_gdn_verify(*args, par[None].int().to(dev), torch.tensor([n], device=dev),
                                   dpool, sidx.to(dev), precision="ieee")
        if sl.start == 0:
            tree_gdn_commit(dpool, sidx.to(dev), torch.tensor([leaf], device=dev), stash,
                            precision="ieee")
    # float64: the path root..leaf of tree 1 as a chain, then tree 2 hanging from its end
    path = []
    j = leaf
    while j >= 0:
        path.append(j)
        j = int(p1[j])
    path = path[::-1]
    idx = torch.tensor(path + list(range(n1, n1 + n2)))
    parent = torch.cat([torch.arange(len(path)) - 1, torch.where(p2 < 0, len(path) - 1, p2 + len(path))])
    ro, *_ = ref.tree_gdn_recurrent(q[:, idx], k[:, idx], v[:, idx], g[:, idx], beta[:, idx],
                                    parent[None], torch.tensor([idx.numel()]), pool[sidx.long()])
    assert rel_rms(o, ro[:, len(path):]) < 1e-5


def test_single_root_folds_node0_only_where_it_saves_a_block():
    assert [root_folded(True, N, 16) for N in (1, 2, 16, 17, 33, 64, 65, 129)] == [0, 0, 0, 1, 1, 0, 1, 1]
    assert root_folded(True, 65, 32) == 1 and root_folded(True, 33, 32) == 1 and root_folded(False, 65, 16) == 0


def test_single_root_validated_and_detected(kernel_device):
    dev = kernel_device
    gen = torch.Generator().manual_seed(11)
    q, k, v, g, beta, pool, sidx = make_gdn(1, 17, 2, 4, 16, 16, torch.float32, gen)
    d = [t.to(dev) for t in (q, k, v, g, beta)]
    forest = torch.tensor([[-1] + list(range(15)) + [-1]], dtype=torch.int32, device=dev)
    num = torch.tensor([17], device=dev)
    with pytest.raises(ValueError, match="single_root"):
        tree_gdn_verify(*d, forest, num, pool.to(dev), sidx.to(dev), single_root=True)
    # a forest by default: node 16 reads S0, not node 0's state (the float64 reference agrees)
    o, _ = tree_gdn_verify(*d, forest, num, pool.to(dev), sidx.to(dev), precision="ieee")
    ro, *_ = ref.tree_gdn_recurrent(q, k, v, g, beta, forest.cpu(), num.cpu(), pool[sidx.long()])
    assert rel_rms(o, ro) < 1e-5
    assert check_parents(forest, torch.tensor([16])) and not check_parents(forest, num)


def test_references_agree():
    gen = torch.Generator().manual_seed(0)
    for kind, gnorm in (("random", 1.0), ("eagle", 0.01), ("spine", 10.0), ("star", 1.0)):
        parent, num = make_batch(2, 30, [30, 17], kind, gen)
        q, k, v, g, beta, pool, sidx = make_gdn(2, 30, 2, 4, 16, 16, torch.float64, gen, gnorm)
        S0 = pool[sidx.long()]
        o1, S, v1, G1 = ref.tree_gdn_recurrent(q, k, v, g, beta, parent, num, S0)
        o2, v2, G2 = ref.tree_gdn_closed_form(q, k, v, g, beta, parent, num, S0)
        assert (o1 - o2).abs().max() < 1e-10 and (v1 - v2).abs().max() < 1e-10
        for a in (0, 9, 16):
            Sa = ref.tree_gdn_commit(S0, torch.tensor([a, a]), parent, k, v1, G1)
            assert (Sa - S[:, a]).abs().max() < 1e-10


@pytest.mark.parametrize("N", [5, 33, 70, 256])
def test_ancestor_bits(N, kernel_device):
    gen = torch.Generator().manual_seed(N)
    ns = [N, N // 2, 0]
    parent, num = make_batch(3, N, ns, "spine", gen, p_chain=0.7)
    bits = tree_ancestor_bits(parent.to(kernel_device), num.to(kernel_device)).cpu()
    j = torch.arange(N)
    assert torch.equal(((bits[:, :, j // 32] >> (j % 32)) & 1).bool(), ref.ancestor_mask(parent, num))


def test_rejects_non_topological_parents():
    parent = torch.tensor([[-1, 0, 3, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="topological"):
        check_parents(parent, torch.tensor([4]))
    q = torch.randn(1, 4, 1, 16)
    v, g = torch.randn(1, 4, 1, 16), torch.zeros(1, 4, 1)
    with pytest.raises(ValueError, match="topological"):
        tree_gdn_verify(q, q, v, g, g, parent, torch.tensor([4]), torch.zeros(1, 1, 16, 16),
                        torch.tensor([0], dtype=torch.int32))
    check_parents(parent, torch.tensor([2]))  # the bad node is padding


def test_rejects_bad_tuning():
    q = torch.randn(1, 4, 1, 16)
    v, g = torch.randn(1, 4, 1, 16), torch.zeros(1, 4, 1)
    ok = torch.tensor([[-1, 0, 1, 2]], dtype=torch.int32)
    for bad, match in [({"block_c": 48}, "block_c"), ({"block_t": 8}, "block_t"), ({"block_v": 8}, "block_v"),
                       ({"solve_kc": 24}, "solve_kc"), ({"inv_base": 2}, "inv_base")]:
        with pytest.raises(ValueError, match=match):
            tuned(4, "cpu", **bad)
    # PDL where the device cannot run it (CPU tensors)
    with pytest.raises(ValueError, match="compute capability"):
        tree_gdn_verify(q, q, v, g, g, ok, torch.tensor([4]), torch.zeros(1, 1, 16, 16),
                        torch.tensor([0], dtype=torch.int32), tuning=tuned(4, "cpu", pdl=True))
    with pytest.raises(TypeError, match="GDNTuning"):
        tree_gdn_verify(q, q, v, g, g, ok, torch.tensor([4]), torch.zeros(1, 1, 16, 16),
                        torch.tensor([0], dtype=torch.int32), tuning={"block_t": 16})


@pytest.mark.parametrize("W,S,bias,act,dtype", [(4, 3, True, "silu", torch.float32),
                                                (4, 4, False, None, torch.float16),
                                                (2, 1, True, "silu", torch.float32)])
def test_tree_conv1d_and_commit(W, S, bias, act, dtype, kernel_device):
    dev = kernel_device
    gen = torch.Generator().manual_seed(W + S)
    B, N, D = 3, 19, 24
    parent, num = make_batch(B, N, [19, 6, 4], "random", gen)
    x = torch.randn(B, N, D, generator=gen).to(dtype)
    pool = torch.randn(5, D, S, generator=gen).to(dtype)
    w, b = torch.randn(D, W, generator=gen), (torch.randn(D, generator=gen) if bias else None)
    sidx = torch.tensor([3, 0, -1], dtype=torch.int32)
    dpool = pool.to(dev)
    out = tree_conv1d(x.to(dev), dpool, w.to(dev), None if b is None else b.to(dev),
                      parent.to(dev), num.to(dev), sidx.to(dev), activation=act, block_n=8,
                      block_d=16)
    assert torch.equal(dpool.cpu(), pool)
    num_eff = torch.where(sidx >= 0, num, 0)
    want = ref.tree_conv1d(x, pool[sidx.long().clamp(min=0)], w, b, parent, num_eff, act)
    assert rel_rms(out, want) < (1e-6 if dtype == torch.float32 else 2e-3)
    out_idx = torch.tensor([1, 2, 4], dtype=torch.int32)
    for a in (-1, 0, 3, 18):
        leaf = torch.tensor([a, min(a, 5), 0])
        p2 = pool.clone().to(dev)
        tree_conv1d_commit(x.to(dev), p2, leaf.to(dev), parent.to(dev), sidx.to(dev),
                           out_idx.to(dev), block_d=16)
        want = ref.tree_conv1d_commit(x, pool[sidx.long().clamp(min=0)], leaf, parent)
        for r in range(2):
            assert torch.equal(p2[out_idx[r].long()].cpu().double(), want[r].to(dtype).double())
        assert torch.equal(p2[sidx[:2].long()].cpu(), pool[sidx[:2].long()])
        assert torch.equal(p2[4].cpu(), pool[4]), "padded request wrote its out slot"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tree_conv1d_and_commit_read_strided_views(dtype, kernel_device, request):
    """x as the mixed qkv columns of a fused projection's output (rows 37 apart, requests 13 rows apart, an offset of
    5): the conv and the commit read it in place (no copy) and give the contiguous copy's results bit for bit."""
    dev = kernel_device
    gen = torch.Generator().manual_seed(11)
    B, N, D, W, S = 2, 11, 21, 4, 3
    parent, num = make_batch(B, N, [11, 7], "random", gen)
    wide = torch.randn(B, N + 2, 37, generator=gen).to(dtype).to(dev)
    x = wide[:, :N, 5:5 + D]                                                  # [B, N, D] view, last dim contiguous
    pool = torch.randn(3, D, S, generator=gen).to(dtype).to(dev)
    w, b = torch.randn(D, W, generator=gen).to(dev), torch.randn(D, generator=gen).to(dev)
    sidx, leaf = torch.tensor([2, 0], dtype=torch.int32).to(dev), torch.tensor([9, 4]).to(dev)
    args = (pool, w, b, parent.to(dev), num.to(dev), sidx)
    want = tree_conv1d(x.contiguous(), *args, block_n=4, block_d=8)
    want_pool = tree_conv1d_commit(x.contiguous(), pool.clone(), leaf, parent.to(dev), sidx,
                                   torch.tensor([1, 2], dtype=torch.int32).to(dev), block_d=8)
    copied = request.getfixturevalue("strided_copies")                      # from here on
    out = tree_conv1d(x, *args, block_n=4, block_d=8)
    got_pool = tree_conv1d_commit(x, pool.clone(), leaf, parent.to(dev), sidx,
                                  torch.tensor([1, 2], dtype=torch.int32).to(dev), block_d=8)
    assert copied == []
    assert out.is_contiguous() and torch.equal(out, want) and torch.equal(got_pool, want_pool)
    ref_out = ref.tree_conv1d(x.cpu(), pool.cpu()[sidx.long().cpu()], w.cpu(), b.cpu(), parent, num)
    assert rel_rms(out, ref_out) < (1e-6 if dtype == torch.float32 else 2e-3)
    ref_pool = ref.tree_conv1d_commit(x.cpu(), pool.cpu()[sidx.long().cpu()], leaf.cpu(), parent)
    assert torch.equal(got_pool[1:].cpu().double(), ref_pool.to(dtype).double())


@pytest.mark.gpu
@pytest.mark.parametrize("n,kind,cfg", [(16, "chain", {}), (65, "eagle", dict(block_t=16, block_v=32, num_warps=4)),
                                        (65, "eagle", dict(block_t=32, block_v=16, num_warps=4)),
                                        (65, "eagle", dict(block_t=64, block_v=64, num_warps=8)),
                                        (129, "spine", {}), (129, "spine", dict(block_t=16, block_v=16, num_warps=4)),
                                        (129, "spine", dict(block_t=32, block_v=64, num_warps=8)),
                                        (129, "spine", dict(block_t=64, block_v=64, num_warps=8)),
                                        (65, "eagle", dict(prep_split=True)), (129, "spine", dict(prep_split=True)),
                                        (65, "eagle", "root"), (129, "spine", "root"),
                                        (65, "eagle", dict(inv_base=4)), (129, "spine", dict(inv_base=4))],
                         ids=str)
def test_gpu_real_shape_bf16_tf32(n, kind, cfg):
    """Qwen3.6-27B GDN shape, bf16 inputs, tf32 dots: o within bf16 rounding, commit < 2e-3."""
    gen = torch.Generator().manual_seed(n)
    parent, num = make_batch(1, n, [n], kind, gen, p_chain=0.7)
    q, k, v, g, beta, pool, sidx = make_gdn(1, n, 16, 48, 128, 128, torch.bfloat16, gen)
    d = [t.cuda() for t in (q, k, v, g, beta, parent, num, sidx)]
    dpool = pool.cuda()
    root = cfg == "root"
    # the one-launch prep unless the case asks for the split one
    tuning = tuned(n, "cuda", **{"prep_split": False, **({} if root else cfg)})
    o, stash = tree_gdn_verify(*d[:7], dpool, d[7], single_root=root, tuning=tuning)
    ro, S, _, _ = ref.tree_gdn_recurrent(q, k, v, g, beta, parent, num, pool[sidx.long()])
    assert rel_rms(o, ro) < 3e-3
    tree_gdn_commit(dpool, d[7], torch.tensor([n - 1], device="cuda"), stash)
    assert rel_rms(dpool[sidx.long()][0], S[0, n - 1]) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm_90+")
@pytest.mark.parametrize("n", [16, 65, 129])
@pytest.mark.parametrize("single_root", [False, True])
def test_gpu_pdl_launch_matches_plain_launch(n, single_root):
    """The solve launched with PDL (it starts while the prep runs and waits on gdc_wait) gives
    bitwise the outputs and stash of the plain launch, eagerly and replayed in a CUDA graph."""
    gen = torch.Generator().manual_seed(7 + n)
    parent, num = make_batch(1, n, [n], "eagle", gen)
    q, k, v, g, beta, pool, sidx = make_gdn(1, n, 16, 48, 128, 128, torch.bfloat16, gen)
    d = [t.cuda() for t in (q, k, v, g, beta, parent, num)]
    dpool, dsidx = pool.cuda(), sidx.cuda()
    anc = tree_ancestor_bits(d[5], d[6])
    on, off = tuned(n, "cuda", pdl=True), tuned(n, "cuda", pdl=False)
    plain, stash = tree_gdn_verify(*d, dpool, dsidx, anc=anc, tuning=off, single_root=single_root)
    eager, stash_pdl = tree_gdn_verify(*d, dpool, dsidx, anc=anc, tuning=on, single_root=single_root)
    assert torch.equal(eager, plain) and torch.equal(stash_pdl.vnew, stash.vnew)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tree_gdn_verify(*d, dpool, dsidx, anc=anc, tuning=on, single_root=single_root)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed, _ = tree_gdn_verify(*d, dpool, dsidx, anc=anc, tuning=on, single_root=single_root)
    for _ in range(3):
        replayed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, plain)
    # q/k/v written by the kernels just before the verify (as in a model): every replay must see the new values
    src = [t.clone() for t in d[:3]]
    with torch.cuda.stream(s):
        tree_gdn_verify(*[x * 1.0 for x in src], *d[3:], dpool, dsidx, anc=anc, tuning=on, single_root=single_root)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fresh, _ = tree_gdn_verify(*[x * 1.0 for x in src], *d[3:], dpool, dsidx, anc=anc, tuning=on,
                                   single_root=single_root)
    for seed in range(3):
        gen2 = torch.Generator(device="cuda").manual_seed(seed)
        for x in src:
            x.copy_(torch.randn(x.shape, generator=gen2, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want, _ = tree_gdn_verify(*src, *d[3:], dpool, dsidx, anc=anc, tuning=off, single_root=single_root)
        assert torch.equal(fresh, want)
    assert torch.equal(dpool.cpu(), pool), "verify wrote the committed state"


def test_benchmark_quick_configs_are_valid_verify_arguments():
    """Every configuration `benchmarks.kernels.bench_gdn_tree --quick` times passes `tree_gdn_verify`'s checks (run
    with no launch), the default comes first, and PDL is never asked for where it cannot run (a CPU-only torch must not
    raise)."""
    from benchmarks.kernels.bench_gdn_tree import configs_for, default_config, verify_kwargs
    assert not pdl_supported(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for n in (16, 65, 129):
        parent, num = make_batch(1, n, [n], "chain", gen)
        q, k, v, g, beta, pool, sidx = make_gdn(1, n, 1, 1, 16, 16, torch.float32, gen)
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")      # PDL configs validate on CUDA
        parent, num, q, k, v, g, beta, pool, sidx = (x.to(dev) for x in (parent, num, q, k, v, g, beta, pool, sidx))
        cfgs = configs_for(n, quick=True)
        assert cfgs[0] == default_config(n) and len(cfgs) == len({tuple(sorted(c.items())) for c in cfgs})
        assert verify_kwargs(n, cfgs[0])["tuning"] == GDNTuning.for_shape(n, torch.device("cuda"))
        for cfg in cfgs:
            if not pdl_supported(torch.device("cuda")):
                assert not cfg["pdl"]
            tree_gdn_verify(q, k, v, g, beta, parent, num, pool, sidx, stages=(), **verify_kwargs(n, cfg))
