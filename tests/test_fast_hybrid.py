"""The fast hybrid backend (tfm_runtime.fast.hybrid) against Hugging Face and the reference decoder, on tiny float32
Qwen3-Next (MoE) and Qwen3.5 worlds: prefill / decode logits and GDN states equal the HF model's, tree verify and the
committed states equal TreeVerifier's, FastDecoder emits SpeculativeDecoder's and HF's tokens (greedy and sampled),
the Triton GDN path equals the torch one, and bad configs are refused.

The norm weights and dt_bias are perturbed (HF initialises the norms to zero offsets), so a norm applied wrongly
shows. The decoder tests use an 8-token vocabulary so that random drafters get drafts accepted."""
import os

import pytest
import torch
from fast_sampling import assert_sampling_equals_reference

import tfm_runtime.fast.hybrid as hybrid
from tfm_runtime.engine import SpeculativeDecoder
from tfm_runtime.fast import FastDecoder
from tfm_runtime.fast.graphs import GraphedTarget, pad_tree
from tfm_runtime.fast.hybrid import HybridConfig, HybridModel, conv_windows, tree_parents
from tfm_runtime.models.tree_target import TreeVerifier
from tfm_runtime.tree import Tree
from tfm_runtime.verify import verify_greedy
from tfm_runtime.worlds import HYBRID_FAMILIES, tiny_target_config, tiny_world

PROMPT = [5, 17, 33, 2, 91, 14]
SMALL_PROMPT = [5, 7, 3, 2, 1, 4]
ATOL = 2e-5


def perturbed_world(family, **kw):
    w = tiny_world(family, **kw)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in w.target.model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return w


@pytest.fixture(scope="module")
def worlds():
    return {f: perturbed_world(f) for f in HYBRID_FAMILIES}


@pytest.fixture(scope="module")
def small_worlds():
    """Vocabulary 8, seed 1: random drafters get 1-2 drafts accepted per round."""
    return {f: tiny_world(f, vocab_size=8, candidate_pool=8, seed=1) for f in HYBRID_FAMILIES}


def hf_greedy(target, prompt, n):
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def hf_states(cache, model: HybridModel):
    """The GDN layers' (recurrent [Lg, HV, K, V], conv [Lg, C, W-1]) states of an HF cache, in pool order."""
    gdn = [i for i, t in enumerate(model.cfg.layer_types) if t == "linear_attention"]
    rec = torch.stack([cache.layers[i].recurrent_states[0][0] for i in gdn])
    conv = torch.stack([cache.layers[i].conv_states[0][0, :, 1:] for i in gdn])
    return rec, conv


def assert_states(model, rec, conv):
    torch.testing.assert_close(model.rec, rec.float(), atol=ATOL, rtol=0)
    torch.testing.assert_close(model.conv, conv, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_prefill_and_decode_equal_hf(worlds, family, monkeypatch):
    """Logits, hidden, taps and the GDN states after prefill and each decode equal HF's; prefill gives the same in
    chunks of 4 tokens (two chain trees, each committed)."""
    w = worlds[family]
    seq = PROMPT + [40, 7, 250]
    T = len(PROMPT)
    with torch.no_grad():
        ref = w.target(torch.tensor([seq]))
        cache = w.target.new_cache()
        w.target(torch.tensor([PROMPT]), cache=cache, use_cache=True)
    assert ref.logits.std() > 0.1
    for chunk in (64, 4):
        monkeypatch.setattr(hybrid, "PREFILL_CHUNK", chunk)
        model = HybridModel.from_hf(w.target, max_seq_len=32)
        out = model.prefill(torch.tensor(PROMPT))
        torch.testing.assert_close(out.logits[0], ref.logits[0, T - 1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden, ref.h_final[0, :T], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.taps, ref.taps[0, :T], atol=ATOL, rtol=0)
        assert_states(model, *hf_states(cache, model))
    hf_cache = cache
    for pos in range(T, len(seq)):
        logits = model.decode(torch.tensor([seq[pos]]), torch.tensor([pos]))
        torch.testing.assert_close(logits[0], ref.logits[0, pos], atol=ATOL, rtol=0)
        with torch.no_grad():
            w.target(torch.tensor([[seq[pos]]]), cache=hf_cache, use_cache=True)
        assert_states(model, *hf_states(hf_cache, model))


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_safetensors_folder_equals_hf(worlds, family, tmp_path):
    """A folder written by save_pretrained (Qwen3-Next's experts stored one MLP each) loads with the same logits."""
    w = worlds[family]
    w.target.model.save_pretrained(tmp_path)
    with torch.no_grad():
        ref = w.target(torch.tensor([PROMPT])).logits[0, -1]
    model = HybridModel.from_pretrained(str(tmp_path), max_seq_len=16)
    torch.testing.assert_close(model.prefill(torch.tensor(PROMPT)).logits[0], ref, atol=ATOL, rtol=0)


def branchy_tree(path: list[int], vocab: int) -> tuple[Tree, list[int]]:
    """A tree whose greedy path (root = path[0]) sits at nodes 0, 2, 5, 6, with wrong siblings and children around
    it (node 3 hangs off the path, node 4 off a wrong branch); returns the tree and the path's nodes."""
    def other(t, k=1):
        return (t + k) % vocab
    g = path
    tokens = [g[0], other(g[1]), g[1], other(g[2]), other(g[1], 2), g[2], g[3], other(g[4])]
    parents = [-1, 0, 0, 2, 1, 2, 5, 6]
    depths = [0, 1, 1, 2, 2, 2, 3, 4]
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(8)), [0, 2, 5, 6]


def test_tree_helpers():
    parents = torch.tensor([-1, 0, 0, 2, 1, 2, 5, 6])
    tree = Tree(torch.arange(8), parents, torch.tensor([0, 1, 1, 2, 2, 2, 3, 4]), torch.zeros(8))
    assert tree_parents(tree.ancestor_mask()).tolist() == parents.tolist()
    # rows of [state (3 rows) | nodes]: node j is row 3 + j, the newest state entry row 2
    assert conv_windows(parents, 4)[[0, 4, 7]].tolist() == [[0, 1, 2, 3], [2, 3, 4, 7], [5, 8, 9, 10]]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_verify_tree_and_commit_equal_tree_verifier(worlds, family):
    """Two rounds of a branchy tree: verify_tree's outputs equal TreeVerifier's and leave the committed GDN states
    untouched; after committing the accepted path (nodes 0, 2, 5, 6) the GDN states equal the reference's, and
    decoding continues as HF on the committed sequence."""
    w = worlds[family]
    V = w.target.vocab_size
    g = hf_greedy(w.target, PROMPT, 9)
    model = HybridModel.from_hf(w.target, max_seq_len=48)
    verifier = TreeVerifier(w.target, backend="torch")
    cache = w.target.new_cache()
    with torch.no_grad():
        w.target(torch.tensor([PROMPT]), cache=cache, use_cache=True)
    model.prefill(torch.tensor(PROMPT))
    start = len(PROMPT)
    for round in range(2):
        tree, path = branchy_tree(g[start - len(PROMPT):], V)
        anc = tree.ancestor_mask()
        with torch.no_grad():
            ref = verifier.verify(cache, tree.tokens, tree.parents, tree.depths, anc, start)
        rec, conv = model.rec.clone(), model.conv.clone()
        out = model.verify_tree(tree.tokens, tree.depths, anc, start)
        assert torch.equal(model.rec, rec) and torch.equal(model.conv, conv)
        torch.testing.assert_close(out.logits, ref.logits[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden, ref.h_final[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.taps, ref.taps[0], atol=ATOL, rtol=0)
        accepted, bonus = verify_greedy(tree, out.logits)
        assert accepted == path and bonus == g[start - len(PROMPT) + 4], (round, accepted)
        verifier.commit(cache, start, accepted)
        model.commit(start, torch.tensor(accepted))
        assert_states(model, *hf_states(cache, model))
        start += len(accepted)
    committed = PROMPT + g[:start - len(PROMPT)]
    with torch.no_grad():
        ref = w.target(torch.tensor([committed + [g[start - len(PROMPT)]]]))
    logits = model.decode(torch.tensor([g[start - len(PROMPT)]]), start)
    torch.testing.assert_close(logits[0], ref.logits[0, -1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("proposal,budget", [("chain", 8), ("ddtree", 24), ("weaver", 24)])
def test_greedy_equals_reference_decoder_and_hf(small_worlds, family, proposal, budget):
    w = small_worlds[family]
    adapter = w.weaver if proposal == "weaver" else None
    kw = dict(tree_budget=budget, proposal=proposal)
    fast = FastDecoder(w.target, w.drafter, adapter, max_seq_len=64, **kw)
    assert isinstance(fast.model, HybridModel)
    out = fast.generate(SMALL_PROMPT, max_new_tokens=14)
    ref = SpeculativeDecoder(w.target, w.drafter, adapter, **kw).generate(SMALL_PROMPT, max_new_tokens=14)
    assert out.tokens == ref.tokens == hf_greedy(w.target, SMALL_PROMPT, 14)
    assert out.stats.accept_lengths == ref.stats.accept_lengths and out.stats.tree_sizes == ref.stats.tree_sizes
    if proposal != "chain":
        assert max(out.stats.accept_lengths) >= 3          # multi-node commits happen
    assert fast.generate_autoregressive(SMALL_PROMPT, 14).tokens == out.tokens


def test_an_unfinished_weaver_tree_commits_nothing(small_worlds):
    """Trees verified padded with a first phase too short for them (R1 = 1): the unfinished tree's round and the one
    queued after it commit nothing (leaf -1: the GDN states stay; the Triton commits' -1 is tested with the
    kernels), then the finished tree is verified and committed. The reference's tokens and statistics."""
    w = small_worlds["qwen3_next"]
    kw = dict(tree_budget=12, proposal="weaver")
    ref = SpeculativeDecoder(w.target, w.drafter, w.weaver, **kw).generate(SMALL_PROMPT, max_new_tokens=10)
    dec = FastDecoder(w.target, w.drafter, w.weaver, max_seq_len=48, gdn_backend="torch", **kw)
    dec.pad_trees, dec.rounds_ahead = True, 1                             # as on CUDA
    dec.weaver_builder.first_rounds = 1
    out = dec.generate(SMALL_PROMPT, max_new_tokens=10)
    assert out.tokens == ref.tokens and out.stats.accept_lengths == ref.stats.accept_lengths
    assert out.stats.tree_sizes == ref.stats.tree_sizes and out.stats.discarded_rounds >= out.stats.verify_steps


@pytest.mark.parametrize("proposal,verification", [("chain", "chain_sampling"), ("ddtree", "target_only"),
                                                   ("weaver", "traversal")])
def test_sampling_equals_reference_decoder(small_worlds, proposal, verification):
    """At T > 0 with one seed, both decoders draw the same random numbers in the same order: same tokens."""
    assert_sampling_equals_reference(small_worlds["qwen3_next"], SMALL_PROMPT, proposal, verification, budget=12,
                                     max_seq_len=48, new_tokens=12)


@pytest.mark.interpreter
def test_the_rope_and_norm_kernels_stand_in_for_the_torch_ops(worlds, monkeypatch):
    """The attention layers' partial rotary embedding and K/V cache writes as one launch (`tfm_kernels.rope.
    rope_cache`, forced here under the interpreter, fp32): the torch path's logits and caches, bit for bit; with the
    residual adds and their norms fused too (`add_rms_norm`): the same to the norms' summation order."""
    import tfm_runtime.fast.dense as dense
    w = worlds["qwen3_5"]
    tree, path = branchy_tree(hf_greedy(w.target, PROMPT, 5), w.target.vocab_size)
    outs, models = [], []
    for forced in (None, lambda *a: len(a) == 7, lambda *a: True):             # none, rope_into_cache's, all
        if forced:
            monkeypatch.setattr(dense, "inference_kernel_ok", forced)
        m = HybridModel.from_hf(w.target, max_seq_len=32)
        assert m.cfg.rotary_dim < m.cfg.head_dim
        pre = m.prefill(torch.tensor(PROMPT))
        out = m.verify_tree(tree.tokens, tree.depths, tree.ancestor_mask(), len(PROMPT))
        m.commit(len(PROMPT), torch.tensor(path))
        outs.append((pre.logits, out.logits, out.hidden))
        models.append(m)
    for a, b, c in zip(*outs):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, a, atol=ATOL, rtol=0)
    for cache in ("k_cache", "v_cache"):
        assert torch.equal(getattr(models[0], cache), getattr(models[1], cache))
        torch.testing.assert_close(getattr(models[2], cache), getattr(models[0], cache), atol=ATOL, rtol=0)
    assert models[0].k_cache.abs().sum() > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton GDN path on CPU needs the "
                    "interpreter (on CUDA: test_triton_paths_on_cuda)")
def test_triton_gdn_equals_torch_under_interpreter(worlds):
    """The GDN kernels (tree conv, tree verify, commits) give the torch path's outputs and committed states."""
    w = worlds["qwen3_5"]
    tree, _ = branchy_tree([3, 9, 27, 81, 243], w.target.vocab_size)
    anc = tree.ancestor_mask()
    models = [HybridModel.from_hf(w.target, max_seq_len=32, gdn=b) for b in ("torch", "triton")]
    outs = []
    for m in models:
        m.prefill(torch.tensor(PROMPT))
        outs.append(m.verify_tree(tree.tokens, tree.depths, anc, len(PROMPT)))
        m.commit(len(PROMPT), torch.tensor([0, 2, 5, 6]))
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(models[1].rec, models[0].rec, atol=1e-5, rtol=0)
    torch.testing.assert_close(models[1].conv, models[0].conv, atol=1e-5, rtol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_tree_gdn_inputs_kernel_equals_conv_kernel_and_torch_gates():
    """One launch for the tree conv and the gates: the tree conv kernel's output, HF's gate formulas (padding nodes
    of a second request past its node count: zero conv output)."""
    from tfm_kernels.gdn_tree import tree_conv1d
    from tfm_kernels.gdn_tree.inputs import tree_gdn_inputs
    dev = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    gen = torch.Generator().manual_seed(0)
    B, N, D, W, HV = 2, 7, 40, 4, 6
    x, state = torch.randn(B, N, D, generator=gen), torch.randn(3, D, W - 1, generator=gen)
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    a, b = 4 * torch.randn(B, N, HV, generator=gen), torch.randn(B, N, HV, generator=gen)
    a[0, 0, 0] = 30.0                                        # softplus past its threshold
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    parent = torch.tensor([[-1, 0, 0, 1, 3, 2, 5], [-1, 0, 1, 2, 0, 0, 0]])
    n, idx = torch.tensor([7, 5], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
    args = [t.to(dev) for t in (x, state, weight, bias, parent, n, idx)]
    out, g, beta = tree_gdn_inputs(*args, a.to(dev), b.to(dev), A_log.to(dev), dt_bias.to(dev), block_n=4, block_d=16)
    torch.testing.assert_close(out, tree_conv1d(*args, block_n=4, block_d=16), atol=1e-6, rtol=0)
    torch.testing.assert_close(g.cpu(), -A_log.exp() * torch.nn.functional.softplus(a + dt_bias), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(beta.cpu(), b.sigmoid(), atol=1e-6, rtol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_tree_gdn_inputs_kernel_reads_the_fused_projection_in_place(request):
    """x, a, b as the column views of one fused in-projection output [B, N, D + 2 + 2 HV] (as `_gdn_inputs` splits
    it, with z's columns between): no copy, and the contiguous copies' outputs bit for bit."""
    from tfm_kernels.gdn_tree.inputs import tree_gdn_inputs
    dev = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    gen = torch.Generator().manual_seed(1)
    B, N, D, W, HV = 2, 9, 21, 4, 5
    fused = torch.randn(B, N, D + 2 + 2 * HV, generator=gen).to(dev)
    x, _, b, a = fused.split([D, 2, HV, HV], dim=-1)
    state, weight, bias = (torch.randn(3, D, W - 1, generator=gen), torch.randn(D, W, generator=gen),
                           torch.randn(D, generator=gen))
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    parent = torch.tensor([[-1, 0, 0, 1, 3, 2, 5, 0, 7], [-1, 0, 1, 2, 0, 0, 0, 0, 0]])
    n, idx = torch.tensor([9, 5], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
    args = [t.to(dev) for t in (state, weight, bias, parent, n, idx)]
    gates = [t.to(dev) for t in (A_log, dt_bias)]
    want = tree_gdn_inputs(x.contiguous(), *args, a.contiguous(), b.contiguous(), *gates, block_n=4, block_d=8)
    copied = request.getfixturevalue("strided_copies")                      # from here on
    got = tree_gdn_inputs(x, *args, a, b, *gates, block_n=4, block_d=8)
    assert copied == []
    for g_, w_ in zip(got, want):
        assert g_.is_contiguous() and torch.equal(g_, w_)


def test_fused_gdn_in_projection_is_the_hf_weights(monkeypatch):
    """Qwen3.5: from_hf re-homes each GDN layer's in_proj_qkv, z, b, a into one tensor that w_in spans (no copy: the
    HF weights are consecutive row blocks of it, their values and the HF model's logits unchanged, a second from_hf
    copies nothing); `_gdn_inputs` runs one GEMM and returns column views of its output; the logits equal HF's."""
    w = perturbed_world("qwen3_5")
    ids = torch.tensor([PROMPT])
    state = {k: v.clone() for k, v in w.target.model.state_dict().items()}
    with torch.no_grad():
        before = w.target(ids).logits
    m = HybridModel.from_hf(w.target, max_seq_len=32, gdn="torch")
    c = m.cfg
    hv, dv, C = c.gdn_v_heads, c.gdn_v_dim, c.conv_dim
    gdn = [(i, l.mixer) for i, l in enumerate(m.layers) if l.kind == "linear_attention"]
    assert gdn
    for i, mixer in gdn:
        hf = w.target.model.model.layers[i].linear_attn
        assert mixer.w_in.shape == (C + hv * dv + 2 * hv, c.hidden_size)
        start, size = 0, mixer.w_in.element_size() * mixer.w_in.shape[1]
        for lin in (hf.in_proj_qkv, hf.in_proj_z, hf.in_proj_b, hf.in_proj_a):
            assert lin.weight.data_ptr() == mixer.w_in.data_ptr() + start * size
            start += lin.weight.shape[0]
        assert start == mixer.w_in.shape[0]
    assert all(torch.equal(w.target.model.state_dict()[k], v) for k, v in state.items())
    again = HybridModel.from_hf(w.target, max_seq_len=32, gdn="torch")
    assert all(a.mixer.w_in.data_ptr() == b.mixer.w_in.data_ptr() for a, b in zip(again.layers, m.layers)
               if a.kind == "linear_attention")
    calls = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: calls.append(a[1].shape) or real_linear(*a))
    mixed, z, b, a = m._gdn_inputs(gdn[0][1], torch.randn(3, c.hidden_size))
    monkeypatch.undo()
    assert len(calls) == 1
    assert mixed.shape == (3, C) and z.shape == (3, hv, dv) and b.shape == a.shape == (3, hv)
    width = C + hv * dv + 2 * hv
    assert mixed.stride() == (width, 1) and z.stride() == (width, dv, 1) and b.stride() == a.stride() == (width, 1)
    assert z.data_ptr() == mixed.data_ptr() + C * 4 and a.data_ptr() == b.data_ptr() + hv * 4
    with torch.no_grad():
        after = w.target(ids).logits
    assert torch.equal(before, after)
    torch.testing.assert_close(m.prefill(torch.tensor(PROMPT)).logits, after[0, -1:], atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_triton_paths_on_cuda(family):
    """On CUDA (float32), the Triton GDN kernels and tree attention: FastDecoder's greedy tokens equal HF's and the
    torch path's, for a Weaver tree."""
    w = tiny_world(family, vocab_size=8, candidate_pool=8, seed=1)
    for m in (w.target, w.drafter, w.weaver):
        m.cuda()
    kw = dict(tree_budget=16, proposal="weaver", max_seq_len=64)
    fast = FastDecoder(w.target, w.drafter, w.weaver, **kw)
    assert fast.model.gdn == "triton" and fast.model.attention == "triton"
    torch_gdn = FastDecoder(w.target, w.drafter, w.weaver, gdn_backend="torch", **kw)
    a, b = fast.generate(SMALL_PROMPT, 16), torch_gdn.generate(SMALL_PROMPT, 16)
    ids = torch.tensor([SMALL_PROMPT], device="cuda")
    hf = w.target.model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)[0, len(SMALL_PROMPT):].tolist()
    assert a.tokens == b.tokens == hf == fast.generate_autoregressive(SMALL_PROMPT, 16).tokens


@pytest.mark.parametrize("gdn", ["torch", "triton"])
def test_padded_trees_and_the_cpu_fallback_of_cuda_graphs(worlds, small_worlds, gdn):
    """Padding nodes (what a graph of a larger size runs: roots of their own in the GDN layers) leave the real nodes'
    outputs and the committed states unchanged, also where the Triton solve folds node 0 into the state (17 nodes);
    without CUDA, GraphedTarget runs eagerly and FastDecoder(cuda_graphs=True) decodes as without."""
    if gdn == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton GDN path on CPU needs the interpreter (on CUDA: test_cuda_graphs_on_cuda)")
    w = worlds["qwen3_5"]
    tree, path = branchy_tree([3, 9, 27, 81, 243], w.target.vocab_size)
    anc = tree.ancestor_mask()
    models = [HybridModel.from_hf(w.target, max_seq_len=40, gdn=gdn) for _ in range(2)]
    outs = []
    for m, N in zip(models, (8, 17)):
        m.prefill(torch.tensor(PROMPT))
        outs.append(m.verify_tree(*pad_tree(tree.tokens, tree.depths, anc, N), len(PROMPT)))
        m.commit(len(PROMPT), torch.tensor(path))
    for name in ("logits", "hidden", "taps"):
        torch.testing.assert_close(getattr(outs[1], name)[:8], getattr(outs[0], name), atol=1e-4, rtol=0)
    torch.testing.assert_close(models[1].rec, models[0].rec, atol=1e-5, rtol=0)
    torch.testing.assert_close(models[1].conv, models[0].conv, atol=1e-5, rtol=0)
    graphed = GraphedTarget(models[0], (16,))
    assert graphed.hybrid and not graphed.enabled and not graphed.graphs
    if gdn == "triton":                 # the fallback below is the same code on either GDN path (interpreter: slow)
        return
    x = small_worlds["qwen3_5"]
    kw = dict(tree_budget=12, proposal="weaver", max_seq_len=64, gdn_backend=gdn)
    a = FastDecoder(x.target, x.drafter, x.weaver, cuda_graphs=True, **kw)
    b = FastDecoder(x.target, x.drafter, x.weaver, **kw)
    assert a.generate(SMALL_PROMPT, 10).tokens == b.generate(SMALL_PROMPT, 10).tokens
    assert a.generate_autoregressive(SMALL_PROMPT, 6).tokens == b.generate_autoregressive(SMALL_PROMPT, 6).tokens


@pytest.mark.gpu
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("proposal", ["chain", "ddtree", "weaver"])
def test_cuda_graphs_on_cuda(family, proposal):
    """On CUDA (float32), FastDecoder with CUDA graphs (verify, decode, the GDN state commit, tree build) on a hybrid
    target emits the eager fast decoder's and HF's greedy tokens, and leaves the eager decoder's GDN states."""
    w = tiny_world(family, vocab_size=8, candidate_pool=8, seed=1)
    for m in (w.target, w.drafter, w.weaver):
        m.cuda()
    adapter = w.weaver if proposal == "weaver" else None
    kw = dict(tree_budget=16, proposal=proposal, max_seq_len=96)
    graphed = FastDecoder(w.target, w.drafter, adapter, cuda_graphs=True, **kw)
    assert graphed.runner.enabled and sorted(graphed.runner.commits) == [1, graphed.max_nodes]
    assert graphed.commit_graph is not None                             # one commit graph for any path length
    eager = FastDecoder(w.target, w.drafter, adapter, **kw)
    a, b = graphed.generate(SMALL_PROMPT, 24), eager.generate(SMALL_PROMPT, 24)
    packs = [[k for k in d._graphs if k[0] == "accept"] for d in (graphed, eager)]
    assert len(packs[0]) in (1, 2) and not packs[1]    # acceptance and readout in a graph (2: a held tree's finish)
    assert a.tokens == b.tokens and a.stats.accept_lengths == b.stats.accept_lengths
    torch.testing.assert_close(graphed.model.rec, eager.model.rec, atol=1e-5, rtol=0)
    torch.testing.assert_close(graphed.model.conv, eager.model.conv, atol=1e-5, rtol=0)
    ids = torch.tensor([SMALL_PROMPT], device="cuda")
    hf = w.target.model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)[0, len(SMALL_PROMPT):].tolist()
    assert a.tokens == hf == graphed.generate_autoregressive(SMALL_PROMPT, 24).tokens
    eager.generate_autoregressive(SMALL_PROMPT, 24)                  # the decode graph commits GDN states too
    torch.testing.assert_close(graphed.model.rec, eager.model.rec, atol=1e-5, rtol=0)


def test_bad_configs_are_refused(worlds, monkeypatch):
    """What the fast hybrid target cannot run is refused by name; the Qwen3.6-27B shape is accepted."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    big = HybridConfig.from_hf(Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, rope_parameters={
            "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_interleaved": True,
            "mrope_section": [11, 11, 10]}))
    assert big.layer_types.count("linear_attention") == 48 and big.rotary_dim == 64 and big.conv_dim == 10240
    cfg = tiny_target_config("qwen3_5")
    assert HybridConfig.from_hf(cfg).rotary_dim == 4
    bad = [({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                 "original_max_position_embeddings": 64}}, "rope type 'yarn'"),
           ({"layer_types": ["sliding_attention"] + cfg.layer_types[1:]}, "has \\['sliding_attention'\\]"),
           ({"hidden_act": "gelu"}, "hidden_act='silu'"),
           ({"attention_bias": True}, "attention_bias"),
           ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
           ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
            "must be even")]
    for change, match in bad:
        d = {**cfg.to_dict(), **change}
        with pytest.raises(ValueError, match=match):
            HybridConfig.from_hf(d)
    with pytest.raises(ValueError, match="model types.*Qwen3_5ForCausalLM"):
        HybridConfig.from_hf({"model_type": "qwen3_5"})
    with pytest.raises(ValueError, match="model types"):
        HybridConfig.from_hf({"model_type": "llama"})
    w = worlds["qwen3_next"]
    with pytest.raises(ValueError, match="gdn must be"):
        HybridModel.from_hf(w.target, max_seq_len=16, gdn="chunked")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="gdn must be"):
        HybridModel.from_hf(w.target, max_seq_len=16, gdn="triton")
    state = {k: v for k, v in w.target.model.state_dict().items() if "conv1d" not in k}
    with pytest.raises(ValueError, match="weights missing.*conv1d"):
        HybridModel(HybridConfig.from_hf(w.target.config), state)
    model = HybridModel.from_hf(w.target, max_seq_len=16)
    with pytest.raises(RuntimeError, match="verify_tree first"):
        model.commit(0, torch.tensor([0]))
    with pytest.raises(ValueError, match="static cache"):
        model.verify_tree(torch.zeros(4, dtype=torch.long), torch.arange(4), torch.ones(4, 4).tril().bool(), 13)
