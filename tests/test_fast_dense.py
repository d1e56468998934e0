"""The fast dense backend (tfm_runtime.fast) against Hugging Face and the reference decoder, on tiny float32 worlds:
prefill / decode logits equal the HF model's, tree verify equals TreeVerifier's, commit keeps exactly the accepted
path, FastDecoder emits SpeculativeDecoder's tokens and statistics (greedy and sampled), and bad inputs are refused.

The decoder tests use an 8-token vocabulary so that random drafters still get drafts accepted (paths of 2-3 nodes,
not always contiguous in the tree), which exercises the commit."""
import pytest
import torch
from fast_sampling import assert_sampling_equals_reference

from tfm_runtime.engine import SpeculativeDecoder
from tfm_runtime.fast import DenseConfig, DenseModel, DenseOutput, FastDecoder, GraphedTarget
from tfm_runtime.fast.graphs import pad_tree
from tfm_runtime.fast.weaver_tree import ancestor_masks, weaver_tree_rounds
from tfm_runtime.models.tree_target import TreeVerifier
from tfm_runtime.tree import Tree
from tfm_runtime.verify import verify_greedy, verify_greedy_best
from tfm_runtime.worlds import tiny_world

DENSE = ("llama", "qwen3")
PROMPT = [5, 17, 33, 2, 91, 14]
SMALL_PROMPT = [5, 7, 3, 2, 1, 4]
ATOL = 2e-5


@pytest.fixture(scope="module")
def worlds():
    return {f: tiny_world(f) for f in DENSE}


@pytest.fixture(scope="module")
def small_worlds():
    """Vocabulary 8: random drafters get 1-2 drafts accepted per round."""
    return {f: tiny_world(f, vocab_size=8, candidate_pool=8) for f in DENSE}


def hf_greedy(target, prompt, n):
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", DENSE)
def test_prefill_and_decode_equal_hf(worlds, family):
    w = worlds[family]
    model = DenseModel.from_hf(w.target, max_seq_len=32)
    seq = PROMPT + [40, 7, 250]
    with torch.no_grad():
        ref = w.target(torch.tensor([seq]))
    out = model.prefill(torch.tensor(PROMPT))
    T = len(PROMPT)
    torch.testing.assert_close(out.logits[0], ref.logits[0, T - 1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden, ref.h_final[0, :T], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.taps, ref.taps[0, :T], atol=ATOL, rtol=0)
    for pos in range(T, len(seq)):
        logits = model.decode(torch.tensor([seq[pos]]), torch.tensor([pos]))
        torch.testing.assert_close(logits[0], ref.logits[0, pos], atol=ATOL, rtol=0)


def test_fused_projections_share_the_hf_model_s_weights(tmp_path):
    """from_hf re-homes each layer's q/k/v and gate/up weights (and biases) into one tensor, values unchanged: the
    HF model computes and saves exactly as before, the fast model's fused weights are views of the same memory (an
    in-place update reaches both), its logits equal the HF model's, and a second from_hf copies nothing."""
    from transformers import LlamaForCausalLM
    cfg = tiny_world("llama").target.model.config
    cfg.attention_bias, cfg.mlp_bias = True, True
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    seq = torch.tensor([PROMPT])
    with torch.no_grad():
        want = hf(seq).logits[0]
    model = DenseModel.from_hf(hf, max_seq_len=16)
    attn, mlp, layer = hf.model.layers[1].self_attn, hf.model.layers[1].mlp, model.layers[1]
    for fused, parts in ((layer.wqkv, (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)),
                         (layer.bqkv, (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)),
                         (layer.w_gate_up, (mlp.gate_proj.weight, mlp.up_proj.weight)),
                         (layer.b_gate_up, (mlp.gate_proj.bias, mlp.up_proj.bias))):
        start = 0
        for p in parts:                                   # consecutive row blocks of the fast model's tensor
            assert p.data_ptr() == fused.data_ptr() + start * fused.element_size()
            start += p.numel()
        assert start == fused.numel()
    after = hf.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    with torch.no_grad():
        assert torch.equal(hf(seq).logits[0], want)
    torch.testing.assert_close(model.prefill(seq[0]).logits[0], want[-1], atol=ATOL, rtol=0)
    assert DenseModel.from_hf(hf, max_seq_len=16).layers[1].wqkv.data_ptr() == layer.wqkv.data_ptr()
    with torch.no_grad():
        attn.k_proj.weight.add_(1.0)                      # shared memory, as before the fusion
    assert torch.equal(layer.wqkv[cfg.num_attention_heads * cfg.head_dim:][:1], attn.k_proj.weight[:1])
    hf.save_pretrained(tmp_path)
    again = LlamaForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in hf.state_dict().items())


def branchy_tree(path: list[int], vocab: int) -> tuple[Tree, list[int]]:
    """A tree whose true greedy path (root = path[0]) sits at nodes 0, 2, 5, 6, with wrong siblings and children
    around it; returns the tree and the nodes of the path."""
    def other(t, k=1):
        return (t + k) % vocab
    g = path
    tokens = [g[0], other(g[1]), g[1], other(g[2]), other(g[1], 2), g[2], g[3], other(g[4])]
    parents = [-1, 0, 0, 2, 1, 2, 5, 6]
    depths = [0, 1, 1, 2, 2, 2, 3, 4]
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(8)), [0, 2, 5, 6]


@pytest.mark.parametrize("family", DENSE)
def test_verify_tree_and_commit_equal_tree_verifier_and_hf(worlds, family):
    """verify_tree's logits, hidden and taps equal TreeVerifier's for a branchy tree; after committing the accepted
    path (nodes 0, 2, 5, 6: not contiguous), decoding continues exactly as HF on the committed sequence, and a
    second tree verify again equals TreeVerifier's."""
    w = worlds[family]
    V = w.target.vocab_size
    g = hf_greedy(w.target, PROMPT, 9)
    model = DenseModel.from_hf(w.target, max_seq_len=48)
    verifier = TreeVerifier(w.target)
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
        out = model.verify_tree(tree.tokens, tree.depths, anc, start)
        torch.testing.assert_close(out.logits, ref.logits[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden, ref.h_final[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.taps, ref.taps[0], atol=ATOL, rtol=0)
        accepted, bonus = verify_greedy(tree, out.logits)
        assert accepted == path and bonus == g[start - len(PROMPT) + 4], (round, accepted)
        verifier.commit(cache, start, accepted)
        model.commit(start, torch.tensor(accepted))
        start += len(accepted)
    committed = PROMPT + g[:start - len(PROMPT)]
    with torch.no_grad():
        ref = w.target(torch.tensor([committed + [g[start - len(PROMPT)]]]))
    logits = model.decode(torch.tensor([g[start - len(PROMPT)]]), start)
    torch.testing.assert_close(logits[0], ref.logits[0, -1], atol=ATOL, rtol=0)


@pytest.mark.interpreter
@pytest.mark.parametrize("family", DENSE)
def test_the_rope_kernel_stands_in_for_rotate_and_the_cache_writes(worlds, family, monkeypatch):
    """In CUDA inference a layer's rotary embedding and its K/V cache writes are one launch
    (`tfm_kernels.rope.rope_cache`, with the norms' kernel), and over few rows its projections with their norms,
    swiglu and residual adds four (`tfm_kernels.small_linear`). Forced here (the Triton interpreter, fp32), a prefill,
    a tree verify and a commit give the torch path's logits and caches (to the norms' summation order)."""
    import tfm_runtime.fast.dense as dense
    w = worlds[family]
    tree, path = branchy_tree(hf_greedy(w.target, PROMPT, 5), w.target.vocab_size)
    outs, models = [], []
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(dense, "inference_kernel_ok", lambda *a: True)
            monkeypatch.setattr(dense, "small_linear_ok", lambda *a: True)
        m = DenseModel.from_hf(w.target, max_seq_len=32)
        pre = m.prefill(torch.tensor(PROMPT))
        out = m.verify_tree(tree.tokens, tree.depths, tree.ancestor_mask(), len(PROMPT))
        m.commit(len(PROMPT), torch.tensor(path))
        outs.append((pre.logits, out.logits, out.hidden))
        models.append(m)
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
    n = len(PROMPT) + len(path)
    for cache in ("k_cache", "v_cache"):
        a, b = (getattr(m, cache)[:, :, :n] for m in models)
        assert a.abs().sum() > 0
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("proposal,budget", [("chain", 8), ("ddtree", 32), ("weaver", 32)])
def test_greedy_equals_reference_decoder_and_hf(small_worlds, family, proposal, budget):
    w = small_worlds[family]
    adapter = w.weaver if proposal == "weaver" else None
    kw = dict(tree_budget=budget, proposal=proposal)
    fast = FastDecoder(w.target, w.drafter, adapter, max_seq_len=96, **kw).generate(SMALL_PROMPT, max_new_tokens=20)
    ref = SpeculativeDecoder(w.target, w.drafter, adapter, **kw).generate(SMALL_PROMPT, max_new_tokens=20)
    assert fast.tokens == ref.tokens == hf_greedy(w.target, SMALL_PROMPT, 20)
    assert fast.stats.accept_lengths == ref.stats.accept_lengths
    assert fast.stats.tree_sizes == ref.stats.tree_sizes
    assert fast.stats.new_tokens == 20 and fast.stats.verify_steps == len(ref.stats.accept_lengths)
    if proposal != "chain":
        assert max(fast.stats.accept_lengths) >= 3          # multi-node commits happen


def test_profiled_stages_and_the_one_host_read(small_worlds):
    """profile=True times every stage (a sync after each); off, the loop is one `step` entry and the same tokens come
    out. The round's readout (one copy) holds the verified tree, the target's argmax per node and the path the
    device accepted, which is the greedy verifier's."""
    w = small_worlds["llama"]
    plain = FastDecoder(w.target, w.drafter, w.weaver, tree_budget=16, proposal="weaver", max_seq_len=96)
    profiled = FastDecoder(w.target, w.drafter, w.weaver, tree_budget=16, proposal="weaver", max_seq_len=96,
                           profile=True)
    assert plain.rounds_ahead == 0                                        # the CPU: no round queued ahead
    plain.rounds_ahead = 1                                                # as on CUDA
    a, b = plain.generate(SMALL_PROMPT, max_new_tokens=12), profiled.generate(SMALL_PROMPT, max_new_tokens=12)
    assert a.tokens == b.tokens and a.stats.accept_lengths == b.stats.accept_lengths
    assert set(a.stats.seconds) == {"prefill", "step"}
    assert set(b.stats.seconds) == {"prefill", "draft", "tree", "verify", "commit"}
    assert b.stats.discarded_rounds == 0 and a.stats.discarded_rounds <= 1   # one round queued ahead, at most
    trees = plain.weaver_builder.result
    want = trees.tree(0)
    logits = torch.randn(want.num_nodes, 8)                               # the verify of the unpadded tree
    for i in range(want.num_nodes):                                       # the target agrees with each node's
        if want.children(i):                                              # first child: a path to a leaf
            logits[i, int(want.tokens[want.children(i)[0]])] = 10.0
    host, event = plain._accept(trees, DenseOutput(logits, None, None), hold=False)
    assert event is None
    packed, acc = plain._split_readout(host)
    tree, best, truncated = FastDecoder._unpack(packed)
    assert truncated == bool(trees.truncated[0])
    for k in ("tokens", "parents", "depths", "draft_logprobs"):
        assert torch.equal(getattr(tree, k), getattr(want, k)), k
    assert tree.draft_logprobs.dtype == torch.float64
    assert best.tolist() == logits.argmax(-1)[:want.num_nodes].tolist()
    assert FastDecoder._unpack(FastDecoder._pack(trees, None))[1] is None
    path, bonus = verify_greedy_best(tree, best)
    A = len(path)
    assert A > 2 and not tree.children(path[-1])
    assert acc.tolist() == path + [0] * (plain.amax - A) + [A, path[-1], bonus]
    assert torch.equal(plain.accept_dev.cpu(), acc)
    assert not bool(trees.truncated[0])
    held = plain._split_readout(plain._accept(trees, DenseOutput(logits, None, None), hold=True)[0])[1]
    assert torch.equal(held, acc)                                         # hold: only unfinished trees
    trees.truncated.fill_(True)
    held = plain._split_readout(plain._accept(trees, DenseOutput(logits, None, None), hold=True)[0])[1]
    assert held.tolist() == [0] * plain.amax + [0, -1, int(tree.tokens[0])]   # accepts nothing


@pytest.mark.parametrize("proposal,verification", [("chain", "chain_sampling"), ("ddtree", "target_only"),
                                                   ("weaver", "traversal")])
def test_sampling_equals_reference_decoder(small_worlds, proposal, verification):
    """At T > 0 with one seed, both decoders draw the same random numbers in the same order: same tokens."""
    assert_sampling_equals_reference(small_worlds["qwen3"], SMALL_PROMPT, proposal, verification, budget=16,
                                     max_seq_len=64, new_tokens=16)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("proposal", ["chain", "ddtree", "weaver"])
def test_trees_come_from_the_static_builders(small_worlds, monkeypatch, proposal, padded):
    """FastDecoder builds greedy chains, DDTrees and Weaver trees with its static builders (once per round, never the
    reference builders) and still emits the reference's tokens and statistics; the Weaver trees have short rounds
    (expand < width). padded: the trees go to the verify padded to their largest size with no host read first (the
    CUDA-graph path)."""
    w = small_worlds["llama"]
    adapter = w.weaver if proposal == "weaver" else None
    kw = dict(tree_budget={"chain": 8, "ddtree": 32, "weaver": 16}[proposal], proposal=proposal, expand=2, width=4)
    ref = SpeculativeDecoder(w.target, w.drafter, adapter, **kw).generate(SMALL_PROMPT, max_new_tokens=16)
    dec = FastDecoder(w.target, w.drafter, adapter, max_seq_len=64, **kw)
    dec.pad_trees, dec.rounds_ahead = padded, 1                           # rounds queued ahead, as on CUDA
    if proposal == "weaver":
        b = dec.weaver_builder
        assert dec.ddtree_builder is None
        assert (b.batch, b.budget, b.width, b.E, b.rounds) == (1, 16, 4, 2, weaver_tree_rounds(16, 4, b.L))
    elif proposal == "ddtree":
        b = dec.ddtree_builder
        assert dec.weaver_builder is None and (b.budget, b.L, b.V) == (32, w.drafter.lookahead, 8)
    else:
        b = dec.chain_builder
        assert dec.ddtree_builder is None and b.n == min(8, w.drafter.lookahead)
    builds = []
    real_build = b.build
    monkeypatch.setattr(b, "build", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    monkeypatch.setattr("tfm_runtime.engine.build_weaver_tree", None)      # the reference builders are not called
    monkeypatch.setattr("tfm_runtime.engine.build_ddtree", None)
    monkeypatch.setattr("tfm_runtime.engine.build_chain", None)
    out = dec.generate(SMALL_PROMPT, max_new_tokens=16)
    assert out.tokens == ref.tokens
    assert out.stats.accept_lengths == ref.stats.accept_lengths and out.stats.tree_sizes == ref.stats.tree_sizes
    assert len(builds) == out.stats.verify_steps + out.stats.discarded_rounds   # rounds queued ahead, unused
    if proposal != "chain":                           # random chains are rejected at once here
        assert max(out.stats.accept_lengths) >= 3


@pytest.mark.parametrize("ahead", [0, 1])
@pytest.mark.parametrize("padded", [False, True])
def test_a_weaver_tree_finished_after_the_verify_is_verified_again(small_worlds, monkeypatch, padded, ahead):
    """A first phase too short for every tree (R1 = 1 round). Padded (the CUDA-graph path), the build runs its
    first phase only, the unfinished tree commits nothing (nor does the round queued after it, which builds the same
    tree), the host reads it, the second phase completes it and the tree is verified again; unpadded, the build
    completes it before the verify. Either way: the reference's tokens and statistics, and every verify but the
    discarded rounds' is a round of the output."""
    w = small_worlds["llama"]
    kw = dict(tree_budget=16, proposal="weaver")
    ref = SpeculativeDecoder(w.target, w.drafter, w.weaver, **kw).generate(SMALL_PROMPT, max_new_tokens=16)
    dec = FastDecoder(w.target, w.drafter, w.weaver, max_seq_len=64, **kw)
    dec.pad_trees, dec.rounds_ahead = padded, ahead
    dec.weaver_builder.first_rounds = 1
    verifies, real = [], dec.runner.verify_tree
    monkeypatch.setattr(dec.runner, "verify_tree", lambda *a: verifies.append(1) or real(*a))
    finishes, real_finish = [], dec.weaver_builder.finish
    monkeypatch.setattr(dec.weaver_builder, "finish", lambda: finishes.append(1) or real_finish())
    out = dec.generate(SMALL_PROMPT, max_new_tokens=16)
    assert out.tokens == ref.tokens and out.stats.accept_lengths == ref.stats.accept_lengths
    assert out.stats.tree_sizes == ref.stats.tree_sizes
    assert len(verifies) == out.stats.verify_steps + out.stats.discarded_rounds
    if padded:                                        # each round: held (and its twin queued ahead), finished
        assert len(finishes) == out.stats.verify_steps
        assert out.stats.discarded_rounds >= (2 * len(finishes) - 1 if ahead else len(finishes))
    else:
        assert out.stats.discarded_rounds <= ahead


@pytest.mark.parametrize("proposal", ["chain", "weaver"])
def test_a_request_that_just_fits_the_cache(small_worlds, proposal):
    """max_seq_len exactly what the request needs (prompt + max_new_tokens + tree nodes - 2): rounds are queued ahead
    of the host's reads only where their trees fit however long the paths in flight are, so the request decodes as
    the reference does; one slot fewer is refused up front."""
    w = small_worlds["llama"]
    adapter = w.weaver if proposal == "weaver" else None
    kw = dict(tree_budget=16, proposal=proposal)
    ref = SpeculativeDecoder(w.target, w.drafter, adapter, **kw).generate(SMALL_PROMPT, max_new_tokens=16)
    nodes = (16 if proposal == "weaver" else min(16, w.drafter.lookahead)) + 1
    need = len(SMALL_PROMPT) + 16 + nodes - 2
    dec = FastDecoder(w.target, w.drafter, adapter, max_seq_len=need, **kw)
    dec.rounds_ahead = 1                                                  # as on CUDA
    out = dec.generate(SMALL_PROMPT, 16)
    assert out.tokens == ref.tokens and out.stats.accept_lengths == ref.stats.accept_lengths
    with pytest.raises(ValueError, match="cache slots"):
        FastDecoder(w.target, w.drafter, adapter, max_seq_len=need - 1, **kw).generate(SMALL_PROMPT, 16)


def test_eos_ends_the_request_as_in_the_reference(small_worlds):
    """An EOS token mid-round: the output stops after it as the reference's does (the round queued after it is
    discarded), and the next request on the same decoder starts clean."""
    w = small_worlds["llama"]
    kw = dict(tree_budget=16, proposal="weaver")
    dec, ref = FastDecoder(w.target, w.drafter, w.weaver, max_seq_len=64, **kw), SpeculativeDecoder(
        w.target, w.drafter, w.weaver, **kw)
    dec.rounds_ahead = 1                                                  # as on CUDA
    full = dec.generate(SMALL_PROMPT, max_new_tokens=16)
    eos = full.tokens[6]
    a, b = dec.generate(SMALL_PROMPT, 16, eos_token_id=eos), ref.generate(SMALL_PROMPT, 16, eos_token_id=eos)
    assert a.tokens == b.tokens == full.tokens[:full.tokens.index(eos) + 1]
    assert a.stats.accept_lengths == b.stats.accept_lengths and a.stats.discarded_rounds <= 1
    assert dec.generate(SMALL_PROMPT, max_new_tokens=16).tokens == full.tokens


def test_ancestor_masks_equal_the_tree_s():
    """ancestor_masks on padded rows: the real nodes' rows are Tree.ancestor_mask, padding sees only itself."""
    tree, _ = branchy_tree([3, 1, 4, 1, 5], 8)
    n, N = tree.num_nodes, 11
    parents = torch.full((2, N), -1)
    parents[0, :n] = tree.parents
    parents[1, :4] = torch.tensor([-1, 0, 1, 2])                                         # a chain of 4
    masks = ancestor_masks(parents, 4)
    want = torch.eye(N, dtype=torch.bool)
    want[:n, :n] = tree.ancestor_mask()
    assert torch.equal(masks[0], want)
    assert torch.equal(masks[1, :4, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(masks[1, 4:], torch.eye(N, dtype=torch.bool)[4:])
    g = torch.Generator().manual_seed(0)
    for depth in (1, 2, 5, 15, 16):                     # a chain as deep as max_depth, and random trees
        chain = torch.arange(-1, depth)[None]                                             # [1, depth + 1]
        assert torch.equal(ancestor_masks(chain, depth)[0], torch.ones(depth + 1, depth + 1, dtype=torch.bool).tril())
        par = torch.tensor([-1] + [int(torch.randint(max(0, i - 3), i, (1,), generator=g)) for i in range(1, 40)])
        d = [0] * 40
        for i in range(1, 40):
            d[i] = d[int(par[i])] + 1
        tree = Tree(tokens=torch.arange(40), parents=par, depths=torch.tensor(d),
                    draft_logprobs=torch.zeros(40, dtype=torch.float64))
        assert torch.equal(ancestor_masks(par[None], max(d))[0], tree.ancestor_mask())


@pytest.mark.parametrize("family", DENSE)
def test_autoregressive_equals_hf_greedy(worlds, family):
    w = worlds[family]
    dec = FastDecoder(w.target, w.drafter, max_seq_len=48)
    out = dec.generate_autoregressive(PROMPT, max_new_tokens=24)
    assert out.tokens == hf_greedy(w.target, PROMPT, 24)
    assert out.stats.new_tokens == 24
    eos = out.tokens[5]
    assert dec.generate_autoregressive(PROMPT, 24, eos_token_id=eos).tokens == out.tokens[:out.tokens.index(eos) + 1]


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_rope_scaling_and_safetensors_folder_equal_hf(tmp_path, rope):
    """Scaled RoPE (linear, llama3) as transformers computes it; a tied-embedding model saved with
    save_pretrained (no lm_head in the file) loads from its folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
                      rope_scaling={"rope_theta": 500.0, **rope})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 64, (40,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1]
    for model in (DenseModel.from_hf(hf, max_seq_len=64), DenseModel.from_pretrained(str(tmp_path), max_seq_len=64)):
        torch.testing.assert_close(model.prefill(ids).logits[0], ref, atol=ATOL, rtol=0)


def test_bad_inputs_are_refused(worlds):
    from transformers import Qwen3Config
    w = worlds["llama"]
    hybrid = tiny_world("qwen3_5")
    with pytest.raises(ValueError, match="hybrid"):
        DenseConfig.from_hf(hybrid.target.config)
    sizes = dict(vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="full attention only.*'sliding_attention'"):
        DenseConfig.from_hf(Qwen3Config(use_sliding_window=True, sliding_window=16, max_window_layers=3, **sizes))
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        DenseConfig.from_hf(Qwen3Config(rope_scaling={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                      "original_max_position_embeddings": 256}, **sizes))
    with pytest.raises(ValueError, match="model types"):
        DenseConfig.from_hf({"model_type": "gpt2", "vocab_size": 10})
    dec = FastDecoder(w.target, w.drafter, max_seq_len=40, tree_budget=8)
    with pytest.raises(ValueError, match="empty"):
        dec.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_seq_len=40"):
        dec.generate(PROMPT, max_new_tokens=40 - len(PROMPT) - 8 + 2)
    with pytest.raises(ValueError, match="max_seq_len=40"):
        dec.generate_autoregressive(PROMPT, max_new_tokens=40)
    assert len(dec.generate(PROMPT, max_new_tokens=40 - len(PROMPT) - 8 + 1).tokens) == 40 - len(PROMPT) - 8 + 1
    with pytest.raises(ValueError, match="static cache"):
        dec.model.verify_tree(torch.zeros(4, dtype=torch.long), torch.arange(4), torch.ones(4, 4).tril().bool(), 37)
    with pytest.raises(ValueError, match="CUDA only"):
        DenseModel.from_hf(w.target, attention="triton")


def test_padded_trees_and_the_cpu_fallback_of_cuda_graphs(small_worlds):
    """Padding nodes (what a graph of a larger size runs) leave the real nodes' outputs unchanged; without CUDA,
    GraphedTarget runs eagerly and FastDecoder(cuda_graphs=True) decodes as without."""
    w = small_worlds["llama"]
    model = DenseModel.from_hf(w.target, max_seq_len=32)
    tree, _ = branchy_tree([3, 1, 4, 1, 5], 8)
    anc = tree.ancestor_mask()
    model.prefill(torch.tensor(SMALL_PROMPT))
    plain = model.verify_tree(tree.tokens, tree.depths, anc, len(SMALL_PROMPT))
    padded = model.verify_tree(*pad_tree(tree.tokens, tree.depths, anc, 13), len(SMALL_PROMPT))
    torch.testing.assert_close(padded.logits[:8], plain.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(padded.taps[:8], plain.taps, atol=ATOL, rtol=0)
    graphed = GraphedTarget(model, (16,))
    assert not graphed.enabled and not graphed.graphs
    kw = dict(tree_budget=16, proposal="ddtree", max_seq_len=64)
    assert FastDecoder(w.target, w.drafter, cuda_graphs=True, **kw).generate(SMALL_PROMPT, 12).tokens == \
        FastDecoder(w.target, w.drafter, **kw).generate(SMALL_PROMPT, 12).tokens


@pytest.mark.gpu
@pytest.mark.parametrize("proposal", ["chain", "ddtree", "weaver"])
def test_cuda_graphs_equal_eager_on_cuda(proposal):
    """On CUDA (float32), FastDecoder with CUDA graphs (verify, decode, tree build) emits the eager fast decoder's
    and HF's greedy tokens."""
    w = tiny_world("qwen3", vocab_size=8, candidate_pool=8)
    for m in (w.target, w.drafter, w.weaver):
        m.cuda()
    adapter = w.weaver if proposal == "weaver" else None
    kw = dict(tree_budget=16, proposal=proposal, max_seq_len=96)
    graphed = FastDecoder(w.target, w.drafter, adapter, cuda_graphs=True, **kw)
    assert graphed.runner.enabled and sorted(graphed.runner.graphs) == [1, graphed.max_nodes]
    assert graphed.commit_graph is not None                             # one commit graph for any path length
    eager = FastDecoder(w.target, w.drafter, adapter, **kw)
    a, b = graphed.generate(SMALL_PROMPT, 24), eager.generate(SMALL_PROMPT, 24)
    packs = [[k for k in d._graphs if k[0] == "accept"] for d in (graphed, eager)]
    assert len(packs[0]) in (1, 2) and not packs[1]    # acceptance and readout in a graph (2: a held tree's finish)
    assert a.tokens == b.tokens and a.stats.accept_lengths == b.stats.accept_lengths
    assert a.stats.tree_sizes == b.stats.tree_sizes
    static = {"chain": "chain_builder", "ddtree": "ddtree_builder", "weaver": "weaver_builder"}[proposal]
    assert getattr(graphed, static)._graph is not None and graphed.pad_trees    # the build replays its graph,
    assert getattr(eager, static)._graph is None and not eager.pad_trees        # trees go in padded
    ids = torch.tensor([SMALL_PROMPT], device="cuda")
    hf = w.target.model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)[0, len(SMALL_PROMPT):].tolist()
    assert a.tokens == hf == graphed.generate_autoregressive(SMALL_PROMPT, 24).tokens


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_tree_attention_equals_sdpa_on_cuda(dtype):
    """On CUDA, verify_tree through the Triton kernel equals the SDPA path (same weights, same tree)."""
    w = tiny_world("qwen3", dtype=dtype)
    w.target.model.cuda()
    models = [DenseModel.from_hf(w.target, max_seq_len=64, attention=a) for a in ("sdpa", "triton")]
    tree, _ = branchy_tree([3, 9, 27, 81, 243], w.target.vocab_size)
    outs = []
    for m in models:
        m.prefill(torch.tensor(PROMPT, device="cuda"))
        outs.append(m.verify_tree(tree.tokens.cuda(), tree.depths.cuda(), tree.ancestor_mask().cuda(),
                                  torch.tensor([len(PROMPT)], device="cuda")))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=tol, rtol=0)
