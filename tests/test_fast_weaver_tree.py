"""StaticWeaverTreeBuilder (tfm_runtime/fast/weaver_tree.py) builds the trees `build_weaver_trees` builds: same nodes
in the same order, parents, depths and log q, ties included, in two phases of a data-independent number of steps
with no host reads inside a phase."""
import contextlib
import math

import pytest
import torch

from tfm_runtime.fast.weaver_tree import StaticWeaverTreeBuilder, weaver_tree_first_rounds, weaver_tree_rounds
from tfm_runtime.models.weaver import Weaver, WeaverConfig
from tfm_runtime.weaver_tree import build_weaver_trees

D, V = 24, 64
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}     # log q: rounding of the K/V layout (see assert_same)


def world(seed, dtype=torch.float64, B=2, L=6, K=10, lookahead=None, ties=False, invalid=False, device="cpu"):
    """A tiny random Weaver and B rows of inputs. ties: zero Weaver residual and integer DFlash logits, so equal log q
    within a node and equal scores across nodes are everywhere. invalid: about half the candidates at -inf (never
    all of a row: the reference turns an all -inf row into NaN)."""
    torch.manual_seed(seed)
    w = Weaver(WeaverConfig(d_model=D, d_embed=D, d_rank=16, num_layers=2, num_heads=2, mlp_dim=32,
                            lookahead=lookahead or L, candidate_pool=K)).to(dtype).eval()
    g = torch.Generator().manual_seed(seed + 1000)
    E, W = torch.randn(V, D, generator=g, dtype=dtype), torch.randn(V, D, generator=g, dtype=dtype)
    h, u = torch.randn(B, D, generator=g, dtype=dtype), torch.randn(B, L, D, generator=g, dtype=dtype)
    cand_logits, cand_ids = (2 * torch.randn(B, L, V, generator=g, dtype=dtype)).topk(K, dim=-1)
    if ties:
        torch.nn.init.zeros_(w.lm_head_query_in.weight)
        cand_logits = torch.randint(0, 3, (B, L, K), generator=g).to(dtype).sort(-1, descending=True).values
    if invalid:
        drop = torch.rand(B, L, K, generator=g) < 0.5
        drop[..., 0] = False
        cand_logits = cand_logits.masked_fill(drop, -math.inf)
    roots = torch.randint(0, V, (B,), generator=g)
    t = [x.to(device) for x in (E, W, roots, h, u, cand_ids, cand_logits)]
    return (w.to(device), *t)


def build_both(seed, budget, expand=8, width=None, rounds=None, fused=False, **kw):
    """The static builder's trees and the reference's; `fused`: the frontier steps as the CUDA build runs them (one
    Triton launch each, here under the interpreter)."""
    w, E, W, roots, h, u, ids, logits = world(seed, **kw)
    ref = build_weaver_trees(w, roots.tolist(), h, u, ids, logits, budget, embed_weight=E, lm_head_weight=W,
                             expand=expand, width=width)
    B, L, K = ids.shape
    builder = StaticWeaverTreeBuilder(w, E, W, budget, K=K, L=L, batch=B, expand=expand, width=width, rounds=rounds)
    builder.fused_frontier = fused
    return builder, builder.build(roots, h, u, ids, logits), ref


def assert_same(out, ref, atol):
    """Every row of `out` is the reference tree: tokens, parents, depths exactly; log q to rounding (the reference's
    K/V layout per step depends on how many nodes it expands, so the last bit of a sum can differ) or, atol=0,
    bit for bit."""
    for b, r in enumerate(ref):
        t = out.tree(b).to("cpu")
        assert t.tokens.tolist() == r.tokens.tolist(), b
        assert t.parents.tolist() == r.parents.tolist(), b
        assert t.depths.tolist() == r.depths.tolist(), b
        assert t.draft_logprobs.dtype == r.draft_logprobs.dtype == torch.float64
        torch.testing.assert_close(t.draft_logprobs, r.draft_logprobs, rtol=0, atol=atol)
        n = r.num_nodes
        assert int(out.num_nodes[b]) == n
        assert out.tokens[b, n:].eq(0).all() and out.parents[b, n:].eq(-1).all()   # padding


# (budget, expand, width, K, L, lookahead, B, dtype): default width, width 1, expand < width (short rounds while
# the frontier fills), K < expand, depth L running out (fewer nodes than the budget), a chain (expand 1),
# a Weaver lookahead shorter than the inputs' depths
CASES = [
    (1, 8, None, 10, 6, None, 3, torch.float64),
    (2, 4, 2, 10, 6, None, 2, torch.float32),
    (7, 3, 2, 10, 6, None, 3, torch.float64),
    (16, 8, 1, 10, 6, None, 2, torch.float32),
    (16, 2, 4, 10, 6, None, 3, torch.float64),
    (16, 8, 3, 3, 6, None, 2, torch.float32),
    (64, 8, None, 12, 6, None, 2, torch.float64),
    (64, 8, None, 12, 6, None, 2, torch.float32),
    (64, 4, 8, 10, 2, None, 2, torch.float32),
    (64, 3, 5, 10, 2, None, 3, torch.float64),
    (30, 1, 3, 10, 5, None, 2, torch.float32),
    (24, 5, 3, 10, 6, 3, 2, torch.float64),
]


@pytest.mark.parametrize("budget,expand,width,K,L,lookahead,B,dtype", CASES)
@pytest.mark.parametrize("variant", ["plain", "ties", "invalid"])
def test_equals_reference(budget, expand, width, K, L, lookahead, B, dtype, variant):
    for seed in range(2):
        builder, out, ref = build_both(seed, budget, expand, width, dtype=dtype, B=B, L=L, K=K, lookahead=lookahead,
                                       ties=variant == "ties", invalid=variant == "invalid")
        assert_same(out, ref, TOL[dtype])
        assert not out.truncated.any()
        if variant != "invalid":                  # every node has min(expand, K) children down to depth L
            full = sum(min(expand, K) ** d for d in range(1, min(L, lookahead or L) + 1))
            assert out.num_nodes.tolist() == [min(full, budget) + 1] * B


@pytest.mark.interpreter
@pytest.mark.parametrize("budget,expand,width,K,L,lookahead,B,dtype", CASES)
def test_the_fused_frontier_steps_build_the_same_trees(budget, expand, width, K, L, lookahead, B, dtype):
    for variant in ("plain", "ties", "invalid"):
        builder, out, ref = build_both(0, budget, expand, width, fused=True, dtype=dtype, B=B, L=L, K=K,
                                       lookahead=lookahead, ties=variant == "ties", invalid=variant == "invalid")
        assert builder.fused_frontier
        assert_same(out, ref, TOL[dtype])
        assert not out.truncated.any()


def test_ties_go_to_the_earlier_push():
    """Zero residual, DFlash logits 0/1/2: many children of different parents share a score; the tree places them
    in push order exactly as the heap does, across several rows and widths (and would not with the order reversed)."""
    for seed in range(3):
        for width in (1, 3, 4):
            _, out, ref = build_both(seed, 20, expand=4, width=width, ties=True, B=3, K=6)
            assert_same(out, ref, atol=0)
            scores = [(r.draft_logprobs.tolist()) for r in ref]
            assert any(len(set(s[1:])) < len(s) - 1 for s in scores)          # equal log q occur


def test_bit_identical_when_every_step_is_full():
    """With `width` expandable nodes in every reference step (expand >= width, depth never runs out) both builds run
    the same steps on the same K/V layout: log q equal bit for bit."""
    for dtype in (torch.float32, torch.float64):
        _, out, ref = build_both(3, 64, expand=8, width=4, B=1, L=15, K=12, dtype=dtype)
        assert_same(out, ref, atol=0)


def test_fewer_rounds_give_the_reference_prefix_and_flag_it():
    """rounds = ceil(budget / width) suffices while no round runs short of frontier entries; where one does (expand
    < width) the tree is the reference's first nodes and `truncated` says so."""
    _, out, ref = build_both(0, 32, expand=8, width=4, rounds=8, B=2)
    assert_same(out, ref, TOL[torch.float64])
    assert not out.truncated.any()
    _, out, ref = build_both(0, 32, expand=2, width=4, rounds=8, B=2)
    assert out.truncated.all()
    for b, r in enumerate(ref):
        n = int(out.num_nodes[b])
        assert 1 < n < r.num_nodes
        assert out.tokens[b, :n].tolist() == r.tokens[:n].tolist()
        assert out.parents[b, :n].tolist() == r.parents[:n].tolist()


def test_round_bound():
    assert weaver_tree_rounds(64, 4, 15) == 28 and weaver_tree_rounds(1, 1, 6) == 1
    assert weaver_tree_rounds(16, 1, 6) == 16 and weaver_tree_rounds(64, 4, 1) == 17
    for budget, width, L in [(64, 4, 15), (7, 2, 3), (30, 3, 5)]:
        assert weaver_tree_rounds(budget, width, L) >= math.ceil(budget / width)


@contextlib.contextmanager
def no_host_reads():
    """Any Python-level read of a tensor value (item, tolist, bool, int, float, index, nonzero, numpy) raises."""
    def refuse(*a, **k):
        raise AssertionError("host read of a tensor value inside a build")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy"):
            mp.setattr(torch.Tensor, name, refuse)
        mp.setattr(torch, "nonzero", refuse)
        yield


def test_fixed_steps_and_no_host_reads(monkeypatch):
    """Each phase runs a fixed number of Weaver steps whatever the data (a tree that ends early or a row of padding)
    and reads no tensor value on the host; a build reads `truncated` once between them and runs the second phase
    only for an unfinished tree; buffers keep their addresses from one build to the next."""
    w, E, W, roots, h, u, ids, logits = world(0, B=2, L=2)
    builder = StaticWeaverTreeBuilder(w, E, W, 40, K=10, L=2, batch=2, expand=3, width=4)
    R, R1 = builder.rounds, builder.first_rounds
    assert (R, R1) == (weaver_tree_rounds(40, 4, 2), 11) and R1 < R       # 3 nodes, then 4 per round
    calls, step = [], w.step
    monkeypatch.setattr(w, "step", lambda *a, **k: calls.append(a[1].shape) or step(*a, **k))
    ptrs = [t.data_ptr() for t in (builder.tokens, builder.front_int, builder.visible, builder.state.k[0])]
    inputs = (roots, h, u, ids, logits)
    with no_host_reads():
        builder._first(*inputs)
    assert len(calls) == 1 + R1                               # the root step, then a step in every round
    assert calls[0] == (2, 1) and set(calls[1:]) == {(2, 4)}
    with no_host_reads():
        builder._second(*inputs)
    assert len(calls) == R                                    # the last round places without a step
    calls.clear()
    out = builder.build(*inputs)
    assert (out.num_nodes < 41).all() and not out.truncated.any()    # depth 2 ends the trees within R1 rounds
    assert len(calls) == 1 + R1
    calls.clear()
    _, _, _, roots2, h2, u2, ids2, logits2 = world(1, B=2, L=2, ties=True)
    builder.build(roots2, h2, u2, ids2, logits2)
    assert ptrs == [t.data_ptr() for t in (builder.tokens, builder.front_int, builder.visible, builder.state.k[0])]
    ref = build_weaver_trees(w, roots2.tolist(), h2, u2, ids2, logits2, 40, embed_weight=E, lm_head_weight=W,
                             expand=3, width=4)
    assert_same(builder.result, ref, TOL[torch.float64])


def test_first_rounds():
    assert [weaver_tree_first_rounds(64, w, 8) for w in (1, 4, 8)] == [64, 16, 8]    # ceil(budget / width)
    assert weaver_tree_first_rounds(64, 16, 8) == 5            # 8 nodes (the root's children), then 16 per round
    assert weaver_tree_first_rounds(8, 4, 1) == 8 and weaver_tree_first_rounds(1, 16, 8) == 1


@pytest.mark.parametrize("budget,width", [(64, 16), (128, 32), (40, 12)])
def test_wide_steps_finish_in_the_first_phase(budget, width):
    """Wider than the root's children: the first round is short, yet with valid candidates and depth to spare the
    first phase's R1 rounds finish the tree (no second phase) and build the reference's tree."""
    builder, out, ref = build_both(4, budget, expand=8, width=width, B=2, L=15, K=12)
    assert builder.first_rounds < builder.rounds
    builder._first(*world(4, B=2, L=15, K=12)[3:])
    assert not builder.truncated.any()
    assert_same(out, ref, TOL[torch.float64])


def test_the_second_phase_finishes_trees_that_need_short_rounds(monkeypatch):
    """Half the candidates invalid: rounds run short of frontier entries, R1 rounds (every candidate valid) leave
    the trees unfinished, and the second phase completes them to the reference's trees."""
    w, E, W, roots, h, u, ids, logits = world(2, B=2, L=6, invalid=True)
    builder = StaticWeaverTreeBuilder(w, E, W, 24, K=10, L=6, batch=2, expand=8, width=8)
    assert builder.first_rounds == 3 < builder.rounds
    builder._first(roots, h, u, ids, logits)
    assert builder.truncated.all() and (builder.num_nodes < 25).all()
    calls, step = [], w.step
    monkeypatch.setattr(w, "step", lambda *a, **k: calls.append(a[1].shape) or step(*a, **k))
    out = builder.build(roots, h, u, ids, logits)
    assert len(calls) == builder.rounds and not out.truncated.any()
    ref = build_weaver_trees(w, roots.tolist(), h, u, ids, logits, 24, embed_weight=E, lm_head_weight=W, expand=8,
                             width=8)
    assert_same(out, ref, TOL[torch.float64])
    _, _, _, roots, h, u, ids, logits = world(5, B=2, L=6)          # every candidate valid: the first phase ends
    calls.clear()                                                    # the trees, with no trace of the slots the
    out = builder.build(roots, h, u, ids, logits)                    # last build's second phase filled
    assert len(calls) == 1 + builder.first_rounds and not out.truncated.any()
    ref = build_weaver_trees(w, roots.tolist(), h, u, ids, logits, 24, embed_weight=E, lm_head_weight=W, expand=8,
                             width=8)
    assert_same(out, ref, TOL[torch.float64])


@pytest.mark.interpreter
def test_the_inference_kernels_stand_in_for_the_torch_ops(monkeypatch):
    """In CUDA inference the Weaver's linear layers with their norms, swiglu and residual adds, its norms and its
    rotary embeddings run as single Triton launches (`tfm_kernels.small_linear`, `tfm_kernels.rms_norm`,
    `tfm_kernels.rope`). Forced on here (the Triton interpreter on the CPU, fp32), the static
    build gives the trees the torch ops give, with log q to rounding; the node positions' cos / sin table equals
    `_rope`; and with gradients wanted (training) the torch path runs."""
    import tfm_runtime.models.common as common
    import tfm_runtime.models.weaver as weaver_mod
    w, E, W, roots, h, u, ids, logits = world(3, dtype=torch.float32, B=2, L=6, K=10)
    ref = build_weaver_trees(w, roots.tolist(), h, u, ids, logits, 16, embed_weight=E, lm_head_weight=W, width=2)
    depths = torch.tensor([[0, 3, 6], [6, 1, 0]])
    cos, sin = w._node_rope(depths.device, torch.float32)
    want_cos, want_sin = w._rope(depths + 1, torch.float32)
    assert torch.equal(cos[depths], want_cos) and torch.equal(sin[depths], want_sin)
    assert cos.shape == (w.cfg.lookahead + 1, w.cfg.d_rank // 2)

    used = []

    def forced(x, *params):                       # the real rule, less "on CUDA"
        ok = not (torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad
                                                                        for p in params)))
        used.append(ok)
        return ok
    monkeypatch.setattr(common, "inference_kernel_ok", forced)
    monkeypatch.setattr(weaver_mod, "inference_kernel_ok", forced)
    builder = StaticWeaverTreeBuilder(w, E, W, 16, K=10, L=6, batch=2, width=2)
    assert_same(builder.build(roots, h, u, ids, logits), ref, TOL[torch.float32])
    assert used and all(used)
    used.clear()
    w.prefix(h, u)                                                # grad enabled, parameters require it: torch ops
    assert used and not any(used)


def test_rejects_bad_shapes_and_cpu_capture():
    w, E, W, roots, h, u, ids, logits = world(0, B=2)
    builder = StaticWeaverTreeBuilder(w, E, W, 8, K=10, L=6, batch=2)
    with pytest.raises(ValueError, match="cand_ids must be"):
        builder.build(roots, h, u, ids[:, :, :5], logits)
    with pytest.raises(RuntimeError, match="CUDA"):
        builder.capture(roots, h, u, ids, logits)
    with pytest.raises(ValueError, match="budget"):
        StaticWeaverTreeBuilder(w, E, W, 0, K=10, L=6, batch=2)
    with pytest.raises(ValueError, match="rounds"):
        StaticWeaverTreeBuilder(w, E, W, 8, K=10, L=6, batch=2, rounds=-1)


@pytest.mark.gpu
def test_cuda_graph_replay_equals_reference():
    """The phases of an eager CUDA build synchronise nowhere; captured once and replayed on new inputs (and new
    Weaver weights, copied in place), the builder gives the reference's trees (float32), also where the second
    phase runs (chains: expand 1)."""
    for budget, expand in ((64, 8), (8, 1)):
        w, E, W, roots, h, u, ids, logits = world(0, dtype=torch.float32, B=2, L=6, K=12, device="cuda")
        builder = StaticWeaverTreeBuilder(w, E, W, budget, K=12, L=6, batch=2, expand=expand, width=4)
        builder.build(roots, h, u, ids, logits)                         # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            builder._first(roots, h, u, ids, logits)
            builder._second(roots, h, u, ids, logits)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        builder.capture(roots, h, u, ids, logits)
        for seed in (1, 2):
            w2, _, _, roots, h, u, ids, logits = world(seed, dtype=torch.float32, B=2, L=6, K=12, device="cuda")
            w.load_state_dict(w2.state_dict())
            out = builder.build(roots, h, u, ids, logits)
            torch.cuda.synchronize()
            ref = build_weaver_trees(w, roots.tolist(), h, u, ids, logits, budget, embed_weight=E, lm_head_weight=W,
                                     expand=expand, width=4)
            assert_same(out, [r.to("cpu") for r in ref], atol=1e-4)
            assert not out.truncated.any()


def test_static_state_steps_equal_growing_state():
    """WeaverState.static: the same steps give the same h bit for bit as the growing state; overflow is refused."""
    from tfm_runtime.models.weaver import WeaverState
    w, E, W, roots, h, u, ids, logits = world(0, dtype=torch.float32, B=3, L=6)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        grow = w.prefix(h, u)
        static = WeaverState.static(2, 3, 2, 7, 8, 9, dtype=torch.float32)
        static.reset(w.prefix(h, u))
        for width in (1, 4, 4):
            nt = grow.num_nodes
            tok, dep = torch.randint(0, V, (3, width), generator=g), torch.randint(0, 6, (3, width), generator=g)
            vis = torch.rand(3, width, nt, generator=g) > 0.5
            assert torch.equal(w.step(grow, tok, dep, vis, E), w.step(static, tok, dep, vis, E))
            assert static.num_nodes == grow.num_nodes
        with pytest.raises(ValueError, match="holds 9 node slots"):
            w.step(static, tok, dep, torch.zeros(3, 4, 9, dtype=torch.bool), E)
        # the prefix straight into the static state: the same K/V as `reset`, the node slots cleared
        again = WeaverState.static(2, 3, 2, 7, 8, 9, dtype=torch.float32)
        again.reset(w.prefix(h, u))
        assert w.prefix(h, u, into=static) is static and static.num_nodes == 0
        for a, b in zip(static.k + static.v, again.k + again.v):
            assert torch.equal(a[:, :, :7], b[:, :, :7])
        with pytest.raises(ValueError, match="static state with prefix length 7"):
            w.prefix(h, u, into=WeaverState.static(2, 3, 2, 6, 8, 9, dtype=torch.float32))


def test_feed_graph_inputs_copies_or_checks_the_aliased_tensors():
    """A graph captured on copies gets each input copied in; one captured on the caller's own tensors (alias) takes
    exactly those (no copy) and refuses others, whose values it would never read."""
    from tfm_runtime.fast.graphs import feed_graph_inputs
    a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.long)
    static = (a.clone(), b.clone())
    feed_graph_inputs(static, (a + 1, b + 2), aliased=False)
    assert torch.equal(static[0], a + 1) and torch.equal(static[1], b + 2)
    feed_graph_inputs((a, b), (a, b), aliased=True)                   # the same tensors: nothing to do
    feed_graph_inputs((a[None],), (a[None],), aliased=True)           # views of them too
    with pytest.raises(ValueError, match="alias=True"):
        feed_graph_inputs((a, b), (a.clone(), b), aliased=True)
    with pytest.raises(ValueError, match="captured with"):
        feed_graph_inputs((a, b), (a, b.float()), aliased=False)
