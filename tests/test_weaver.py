"""Weaver: ancestor-only attention, residual scoring over K candidates, training forward, artifact round trip."""
import pytest
import torch

from tfm_runtime.models.weaver import Weaver, WeaverConfig

D, V, L, K = 48, 120, 6, 10


@pytest.fixture()
def setup():
    torch.manual_seed(0)
    w = Weaver(WeaverConfig(d_model=D, d_embed=D, d_rank=32, num_layers=2, num_heads=4, mlp_dim=64, lookahead=L,
                            candidate_pool=K)).double().eval()
    g = torch.Generator().manual_seed(1)
    E, W = torch.randn(V, D, generator=g).double(), torch.randn(V, D, generator=g).double()
    h, u = torch.randn(1, D, generator=g).double(), torch.randn(1, L, D, generator=g).double()
    cl = torch.randn(1, L, V, generator=g).double()
    cand_logits, cand_ids = cl.topk(K, dim=-1)
    return w, E, W, h, u, cand_ids, cand_logits, cl


def grow_tree(w, E, h, u, tokens, parents, depths):
    """Run node steps one node at a time (each node's visible set = its strict ancestors)."""
    st = w.prefix(h, u)
    outs = []
    for i in range(len(tokens)):
        vis = torch.zeros(1, 1, i, dtype=torch.bool)
        p = parents[i]
        while p >= 0:
            vis[0, 0, p] = True
            p = parents[p]
        outs.append(w.step(st, torch.tensor([[tokens[i]]]), torch.tensor([[depths[i]]]), vis, E)[0, 0])
    return torch.stack(outs)


def test_non_ancestor_perturbation_does_not_change_node(setup):
    w, E, W, h, u, *_ = setup
    #        0
    #      1   2
    #     3 4   5
    parents, depths = [-1, 0, 0, 1, 1, 2], [0, 1, 1, 2, 2, 2]
    tokens = [3, 10, 11, 20, 21, 22]
    base = grow_tree(w, E, h, u, tokens, parents, depths)
    # perturb node 2 (not an ancestor of 1, 3, 4): those outputs are unchanged, 2 and its child 5 change
    t2 = list(tokens)
    t2[2] = 99
    pert = grow_tree(w, E, h, u, t2, parents, depths)
    for i in (0, 1, 3, 4):
        torch.testing.assert_close(pert[i], base[i], rtol=0, atol=0)
    for i in (2, 5):
        assert not torch.allclose(pert[i], base[i])
    # perturb node 1 (an ancestor of 3 and 4): they change
    t3 = list(tokens)
    t3[1] = 98
    pert = grow_tree(w, E, h, u, t3, parents, depths)
    assert not torch.allclose(pert[3], base[3]) and not torch.allclose(pert[4], base[4])
    torch.testing.assert_close(pert[5], base[5], rtol=0, atol=0)


def test_batched_step_equals_one_at_a_time(setup):
    w, E, W, h, u, *_ = setup
    parents, depths, tokens = [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2], [3, 10, 11, 20, 21]
    single = grow_tree(w, E, h, u, tokens, parents, depths)
    st = w.prefix(h, u)
    r0 = w.step(st, torch.tensor([[3]]), torch.tensor([[0]]), torch.zeros(1, 1, 0, dtype=torch.bool), E)
    r1 = w.step(st, torch.tensor([[10, 11]]), torch.tensor([[1, 1]]), torch.ones(1, 2, 1, dtype=torch.bool), E)
    vis = torch.tensor([[[True, True, False], [True, False, True]]])
    r2 = w.step(st, torch.tensor([[20, 21]]), torch.tensor([[2, 2]]), vis, E)
    torch.testing.assert_close(torch.cat([r0[0], r1[0], r2[0]]), single, rtol=1e-12, atol=1e-12)


def test_zero_residual_equals_dflash_topk_softmax(setup):
    w, E, W, h, u, cand_ids, cand_logits, full = setup
    torch.nn.init.zeros_(w.lm_head_query_in.weight)
    chain = torch.cat([torch.tensor([[3]]), cand_ids[:, :-1, 0]], dim=1)
    lq = w.forward_chain(h, u, chain, cand_ids, cand_logits, E, W)
    p = torch.softmax(full, -1)                                           # DFlash softmax over the vocab
    restricted = p.gather(-1, cand_ids) / p.gather(-1, cand_ids).sum(-1, keepdim=True)
    torch.testing.assert_close(lq.exp(), restricted, rtol=1e-12, atol=1e-12)


def test_residual_reads_only_candidate_rows(setup):
    w, E, W, h, u, cand_ids, cand_logits, _ = setup
    hn = torch.randn(1, L, 32).double()
    W2 = W.clone()
    mask = torch.ones(V, dtype=torch.bool)
    mask[cand_ids.flatten()] = False
    W2[mask] = float("nan")                          # rows outside the candidates must never be read
    a = w.score(hn, cand_ids, cand_logits, W)
    torch.testing.assert_close(w.score(hn, cand_ids, cand_logits, W2), a, rtol=0, atol=0)
    query = w.lm_head_query_in.weight @ w.out_norm(hn)[..., None]                        # A out_norm(h)
    expected = cand_logits + (W[cand_ids] @ query)[..., 0]
    torch.testing.assert_close(a, torch.log_softmax(expected, -1), rtol=1e-12, atol=1e-12)


def test_score_reads_candidate_rows_by_index(setup):
    """rows: each query scores the candidates of its row of the [R, K] tables, as if those rows were gathered."""
    w, E, W, h, u, cand_ids, cand_logits, _ = setup
    hn = torch.randn(2, 3, 32).double()
    rows = torch.tensor([[0, 5, 5], [2, 0, 1]])
    got = w.score(hn, cand_ids[0], cand_logits[0], W, rows=rows)                       # tables [L, K]
    torch.testing.assert_close(got, w.score(hn, cand_ids[0][rows], cand_logits[0][rows], W), rtol=0, atol=0)
    with pytest.raises(ValueError, match="rows"):
        w.score(hn, cand_ids[0], cand_logits[0], W, rows=rows[:1])
    with pytest.raises(ValueError, match="rows"):
        w.score(hn.requires_grad_(), cand_ids[0], cand_logits[0], W, rows=rows)


@pytest.mark.interpreter
def test_score_takes_the_kernels_in_inference_with_a_parameter_lm_head(monkeypatch):
    """The target's LM head is a parameter that requires a gradient (a Hugging Face model's). Under no_grad nothing
    flows to it, so the scoring takes the candidate kernels (forced onto the CPU here: the Triton interpreter, fp32)
    and gives the torch path's log q; with gradients on, the torch path runs."""
    import tfm_kernels.candidate_logits as kernels
    import tfm_runtime.models.weaver as weaver_mod
    torch.manual_seed(0)
    w = Weaver(WeaverConfig(d_model=D, d_embed=D, d_rank=32, num_layers=2, num_heads=4, mlp_dim=64, lookahead=L,
                            candidate_pool=K)).eval()
    W = torch.nn.Parameter(torch.randn(V, D))
    hn, cl = torch.randn(2, L, 32), torch.randn(2, L, V)
    cand_logits, cand_ids = cl.topk(K, dim=-1)
    rows = torch.tensor([[0, 5, 5], [2, 0, 1]])
    with torch.no_grad():
        want = w.score(hn, cand_ids, cand_logits, W)
        want_rows = w.score(hn[:, :3], cand_ids[0], cand_logits[0], W, rows=rows)
    calls = []
    for name in ("candidate_log_probs", "candidate_logits"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(weaver_mod, "kernel_device", lambda t: True)
    with torch.no_grad():
        got = w.score(hn, cand_ids, cand_logits, W)
        got_rows = w.score(hn[:, :3], cand_ids[0], cand_logits[0], W, rows=rows)
    assert len(calls) == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_rows, want_rows, rtol=1e-5, atol=1e-5)
    assert w.score(hn, cand_ids, cand_logits, W).requires_grad and len(calls) == 2   # a gradient to W: torch


def test_training_forward_equals_chain_of_node_steps(setup):
    w, E, W, h, u, cand_ids, cand_logits, _ = setup
    chain = [3] + cand_ids[0, :-1, 1].tolist()
    nodes = grow_tree(w, E, h, u, chain, list(range(-1, L - 1)), list(range(L)))
    expected = w.score(nodes[None], cand_ids, cand_logits, W)
    got = w.forward_chain(h, u, torch.tensor([chain]), cand_ids, cand_logits, E, W)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    got.sum().backward()                             # differentiable end to end
    assert w.token_in.weight.grad is not None and w.proposal_in.weight.grad.abs().sum() > 0


def test_save_load_round_trip(setup, tmp_path):
    w, E, W, h, u, cand_ids, cand_logits, _ = setup
    chain = torch.tensor([[3] + cand_ids[0, :-1, 0].tolist()])
    a = w.forward_chain(h, u, chain, cand_ids, cand_logits, E, W)
    w.save_pretrained(str(tmp_path / "weaver"))
    w2 = Weaver.from_pretrained(str(tmp_path / "weaver"), dtype=torch.float64)
    assert w2.cfg == w.cfg
    torch.testing.assert_close(w2.forward_chain(h, u, chain, cand_ids, cand_logits, E, W), a, rtol=0, atol=0)


def test_qwen36_27b_preset_parameter_count():
    with torch.device("meta"):
        w = Weaver(WeaverConfig.qwen36_27b())
    n = w.num_parameters()
    print(f"Weaver Qwen3.6-27B preset: {n / 1e6:.2f}M parameters (published: 56.7M)")
    assert abs(n - 56.7e6) / 56.7e6 < 0.01


def test_config_errors():
    with pytest.raises(ValueError, match="num_heads"):
        WeaverConfig(d_model=8, d_embed=8, d_rank=30, num_layers=1, num_heads=4, mlp_dim=8, lookahead=3,
                     candidate_pool=4)
    with pytest.raises(ValueError, match="not a Weaver config"):
        WeaverConfig.from_dict({"architecture": "Other"})


def test_small_attention_equals_sdpa():
    from tfm_runtime.models.weaver import small_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 7, 16, generator=g, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(3, 1, 7, 7, generator=g) > 0.5) | torch.eye(7, dtype=torch.bool)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (small_attention(q, k, v, mask) - want).abs().max() < 1e-12
    assert (small_attention(q, k, v, mask[:1]) - small_attention(q, k, v, mask[:1].expand(3, 1, 7, 7))).abs().max() == 0


def _reference_tree(w, E, W, root, h, u, cand_ids, cand_logits, budget, expand, width):
    """Best-first growth with every node's log q recomputed from scratch by `forward_chain` over its root path
    (no K/V cache, no batching), `width` nodes placed per round as the builder does."""
    import heapq
    tokens, parents, depths, logq, score, frontier, order = [root], [-1], [0], [0.0], [0.0], [], 0

    def path(n):
        out = []
        while n >= 0:
            out.append(tokens[n])
            n = parents[n]
        return out[::-1]

    def expand_nodes(nodes):
        nonlocal order
        for n in nodes:
            if depths[n] >= L:
                continue
            p = path(n)
            lq = w.forward_chain(h, u, torch.tensor([p + [0] * (L - len(p))]), cand_ids, cand_logits, E, W)[0, depths[n]]
            top = lq.topk(min(expand, K))
            for v, c in zip(top.values.tolist(), top.indices.tolist()):
                order += 1
                heapq.heappush(frontier, (-(score[n] + v), order, n, int(cand_ids[0, depths[n], c]), v))

    expand_nodes([0])
    while len(tokens) <= budget and frontier:
        batch = []
        while frontier and len(batch) < width and len(tokens) <= budget:
            neg, _, parent, tok, v = heapq.heappop(frontier)
            tokens.append(tok), parents.append(parent), depths.append(depths[parent] + 1)
            logq.append(v), score.append(-neg)
            batch.append(len(tokens) - 1)
        if len(tokens) <= budget:
            expand_nodes(batch)
    return tokens, parents, depths, logq


@pytest.mark.parametrize("budget,width", [(5, 1), (24, 3), (40, None)])
def test_weaver_trees_in_lockstep_equal_a_from_scratch_reference(setup, budget, width):
    """Three trees grown together (cached K/V, padded batched steps) are each the tree that recomputing every
    node's scores from its root path gives."""
    from tfm_runtime.weaver_tree import build_weaver_tree, build_weaver_trees
    w, E, W, _, _, _, _, _ = setup
    g = torch.Generator().manual_seed(5)
    B = 3
    h, u = torch.randn(B, D, generator=g).double(), torch.randn(B, L, D, generator=g).double()
    cand_logits, cand_ids = torch.randn(B, L, V, generator=g).double().topk(K, dim=-1)
    roots = [7, 11, 7]
    trees = build_weaver_trees(w, roots, h, u, cand_ids, cand_logits, budget, embed_weight=E, lm_head_weight=W,
                               expand=4, width=width)
    for b, t in enumerate(trees):
        ref = _reference_tree(w, E, W, roots[b], h[b:b + 1], u[b:b + 1], cand_ids[b:b + 1], cand_logits[b:b + 1],
                              budget, 4, width or 3)
        assert t.tokens.tolist() == ref[0] and t.parents.tolist() == ref[1] and t.depths.tolist() == ref[2]
        torch.testing.assert_close(t.draft_logprobs, torch.tensor(ref[3], dtype=torch.float64))
        assert t.num_nodes == budget + 1
        one = build_weaver_tree(w, roots[b], h[b], u[b], cand_ids[b], cand_logits[b], budget, embed_weight=E,
                                lm_head_weight=W, expand=4, width=width)
        assert one.tokens.tolist() == ref[0] and one.parents.tolist() == ref[1]
