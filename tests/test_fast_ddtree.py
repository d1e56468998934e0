"""StaticDDTreeBuilder (tfm_runtime/fast/ddtree.py) builds the tree `build_ddtree` builds: same nodes in the same order,
parents, depths and log q bit for bit, ties and -inf logits included; StaticChainBuilder the greedy `build_chain`."""
import math

import pytest
import torch

from tfm_runtime.fast.ddtree import StaticChainBuilder, StaticDDTreeBuilder
from tfm_runtime.tree import build_chain, build_ddtree


def logits_for(seed, L, V, kind, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(L, V, generator=g)
    if kind == "ties":                                    # few distinct values: equal scores across paths everywhere
        x = torch.randint(0, 3, (L, V), generator=g).float()
    if kind == "invalid":                                 # most tokens impossible: fewer paths than the budget
        x = x.masked_fill(torch.rand(L, V, generator=g) < 0.8, -math.inf)
        x[:, 0] = 0.0
    if kind == "peaked":                                  # probability-1 tokens: a child's score equals its parent's
        x = torch.full((L, V), -math.inf)
        x[:, 1] = 0.0
        x[::2, 2] = -1.0
    return x.to(dtype)


def assert_same(out, ref):
    n = ref.num_nodes
    assert int(out.num_nodes[0]) == n
    assert out.tokens[0, :n].tolist() == ref.tokens.tolist()
    assert out.parents[0, :n].tolist() == ref.parents.tolist()
    assert out.depths[0, :n].tolist() == ref.depths.tolist()
    assert out.draft_logprobs[0, :n].tolist() == ref.draft_logprobs.tolist()           # bit for bit
    assert out.tokens[0, n:].eq(0).all() and out.parents[0, n:].eq(-1).all() and out.depths[0, n:].eq(0).all()
    out.tree(0)                                                                         # a valid Tree


@pytest.mark.parametrize("budget,L,V", [(1, 3, 10), (4, 1, 10), (16, 7, 50), (64, 15, 300), (32, 6, 5),
                                        (64, 15, 3), (30, 25, 40)])
@pytest.mark.parametrize("kind", ["plain", "ties", "invalid", "peaked"])
def test_equals_reference(budget, L, V, kind):
    builder = StaticDDTreeBuilder(budget, L, V)
    for seed in range(3):
        for dtype in (torch.float32, torch.bfloat16):
            x = logits_for(seed, L, V, kind, dtype)
            assert_same(builder.build(torch.tensor([7]), x), build_ddtree(7, x, budget))


def test_ties_follow_the_rank_path():
    """Logits 0/1/2: equal scores under different parents are everywhere; the order is the heap's."""
    x = logits_for(0, 6, 8, "ties")
    ref = build_ddtree(3, x, 40)
    score = [0.0]
    for i in range(1, ref.num_nodes):
        score.append(score[int(ref.parents[i])] + float(ref.draft_logprobs[i]))
    pairs = [(i, j) for i in range(1, ref.num_nodes) for j in range(i + 1, ref.num_nodes)
             if score[i] == score[j] and ref.parents[i] != ref.parents[j]]
    assert len(pairs) > 10
    assert_same(StaticDDTreeBuilder(40, 6, 8).build(torch.tensor([3]), x), ref)


@pytest.mark.parametrize("budget,L", [(1, 5), (5, 5), (16, 7)])
def test_chain_equals_reference(budget, L):
    """The greedy chain: min(budget, L) argmax tokens (lowest id on ties), parents and depths in a line, log q the
    reference's (float32, widened)."""
    builder = StaticChainBuilder(budget, L, 12)
    for kind in ("plain", "ties"):
        x = logits_for(1, L, 12, kind)
        ref, _ = build_chain(4, x, budget)
        out = builder.build(torch.tensor([4]), x)
        n = ref.num_nodes
        assert int(out.num_nodes[0]) == n == min(budget, L) + 1 and out.tokens.shape == (1, n)
        assert out.tokens[0].tolist() == ref.tokens.tolist() and out.parents[0].tolist() == ref.parents.tolist()
        assert out.depths[0].tolist() == ref.depths.tolist()
        assert out.draft_logprobs[0].tolist() == ref.draft_logprobs.double().tolist()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="draft_logits"):
        StaticDDTreeBuilder(8, 4, 10).build(torch.tensor([0]), torch.zeros(3, 10))
    with pytest.raises(ValueError, match="budget"):
        StaticDDTreeBuilder(0, 4, 10)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["plain", "ties"])
def test_captured_build_equals_reference_on_cuda(kind):
    """A build captured in a CUDA graph and replayed on new inputs gives the reference's trees (bf16 logits)."""
    builder = StaticDDTreeBuilder(64, 15, 300, "cuda")
    builder.capture(torch.tensor([1], device="cuda"), logits_for(9, 15, 300, kind, torch.bfloat16).cuda())
    for seed in range(3):
        x = logits_for(seed, 15, 300, kind, torch.bfloat16).cuda()
        out = builder.build(torch.tensor([seed], device="cuda"), x)
        assert out.tokens is builder._graph_out.tokens                   # replayed, not rebuilt
        assert_same(out, build_ddtree(seed, x, 64))
