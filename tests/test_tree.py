"""Tree invariants and helpers; the chain and DDTree builders (DDTree against a brute-force top-B)."""
import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from tfm_runtime.tree import Tree, build_chain, build_ddtree


def make_tree(tokens, parents, depths=None, logprobs=None) -> Tree:
    n = len(tokens)
    if depths is None:
        depths = [0] * n
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
    logprobs = torch.zeros(n) if logprobs is None else torch.tensor(logprobs)
    return Tree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
                draft_logprobs=logprobs)


def test_tree_helpers():
    t = make_tree([9, 4, 5, 6, 7, 8], [-1, 0, 0, 1, 1, 3])
    assert t.num_nodes == 6 and not t.is_chain
    assert [t.children(i) for i in range(6)] == [[1, 2], [3, 4], [], [5], [], []]
    assert t.path(5) == [0, 1, 3, 5] and t.path(0) == [0]
    assert t.positions(100).tolist() == [100, 101, 101, 102, 102, 103]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        expected[i, t.path(i)] = True
    assert torch.equal(t.ancestor_mask(), expected)
    moved = t.to("cpu")
    assert all(torch.equal(getattr(moved, f), getattr(t, f)) for f in ("tokens", "parents", "depths", "draft_logprobs"))

    c = Tree.chain([7, 3, 5], [0.0, -0.5, -1.0])
    assert c.is_chain and c.parents.tolist() == [-1, 0, 1] and c.depths.tolist() == [0, 1, 2]
    assert c.draft_logprobs.tolist() == [0.0, -0.5, -1.0] and c.children(1) == [2]
    assert torch.equal(c.ancestor_mask(), torch.ones(3, 3, dtype=torch.bool).tril())
    assert Tree.chain([7]).ancestor_mask().tolist() == [[True]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens=[9, 1, 2], parents=[0, 0, 0]), "root must have parent -1"),
    (dict(tokens=[9, 1, 2], parents=[-1, 2, 0], depths=[0, 2, 1]), r"topological .* parents\[1\] = 2"),
    (dict(tokens=[9, 1, 2], parents=[-1, 0, 3], depths=[0, 1, 2]), r"parents\[2\] = 3"),
    (dict(tokens=[9, 1, 2], parents=[-1, 0, 1], depths=[0, 1, 1]), r"depths\[2\] = 1 but its parent 1"),
    (dict(tokens=[9, 1, 1], parents=[-1, 0, 0]), "duplicate sibling token 1 under parent 0"),
    (dict(tokens=[9, -1], parents=[-1, 0]), "token ids must be >= 0"),
    (dict(tokens=[9, 1], parents=[-1, 0], logprobs=[0.0, float("nan")]), "NaN"),
])
def test_tree_rejects_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_tree(**kwargs)


def test_tree_rejects_bad_tensors():
    ok = dict(tokens=torch.tensor([9, 1]), parents=torch.tensor([-1, 0]), depths=torch.tensor([0, 1]),
              draft_logprobs=torch.zeros(2))
    with pytest.raises(ValueError, match="parents has 3 entries"):
        Tree(**{**ok, "parents": torch.tensor([-1, 0, 0])})
    with pytest.raises(ValueError, match="tokens must be torch.long"):
        Tree(**{**ok, "tokens": torch.tensor([9, 1], dtype=torch.int32)})
    with pytest.raises(ValueError, match="draft_logprobs must be floating"):
        Tree(**{**ok, "draft_logprobs": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(ValueError, match="1-D tensor"):
        Tree(**{**ok, "depths": [0, 1]})
    with pytest.raises(ValueError, match="at least the root"):
        Tree(**{k: v[:0] for k, v in ok.items()})


def test_build_chain_greedy():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 3.0, 0.0], [0.0, 0.0, 1.0]])
    for budget, n in [(0, 0), (2, 2), (3, 3), (10, 3)]:
        tree, probs = build_chain(5, logits, budget)
        assert probs is None and tree.is_chain and tree.num_nodes == n + 1
        assert tree.tokens.tolist() == [5, 1, 0, 2][: n + 1]                    # ties -> lowest id
        torch.testing.assert_close(tree.draft_logprobs[1:], torch.log_softmax(logits[:n], -1)[range(n), tree.tokens[1:]])
    with pytest.raises(ValueError, match="budget"):
        build_chain(5, logits, -1)
    with pytest.raises(ValueError, match=r"\[L, V\]"):
        build_chain(5, logits[0], 2)


def test_build_chain_sampled():
    logits = torch.tensor([[0.0, 1.0, float("-inf"), 0.5], [2.0, 0.0, 0.0, float("-inf")]], dtype=torch.float64)
    T = 0.7
    q = torch.softmax(logits / T, -1)
    tree, probs = build_chain(5, logits, 4, temperature=T, generator=torch.Generator().manual_seed(0))
    assert tree.num_nodes == 3 and probs.shape == (3, 4) and probs.dtype == torch.float64
    torch.testing.assert_close(probs[:2], q)
    assert probs[2].abs().sum() == 0                                           # the last node proposes nothing
    torch.testing.assert_close(tree.draft_logprobs[1:], q[[0, 1], tree.tokens[1:]].log())
    again, _ = build_chain(5, logits, 4, temperature=T, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.tokens, tree.tokens)
    # the depth-1 token follows q[0] (never the -inf token)
    g = torch.Generator().manual_seed(1)
    counts = np.bincount([int(build_chain(5, logits, 1, temperature=T, generator=g)[0].tokens[1])
                          for _ in range(3000)], minlength=4)
    assert counts[2] == 0
    assert stats.chisquare(counts[[0, 1, 3]], 3000 * q[0, [0, 1, 3]].numpy()).pvalue > 1e-3


def _brute_force_top_paths(logp: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    """All token paths of depth 1..L, scored by the sum of per-depth log marginals; the top `budget`."""
    L, V = logp.shape
    scored = []
    for depth in range(1, L + 1):
        for path in itertools.product(range(V), repeat=depth):
            scored.append((sum(float(logp[d, t]) for d, t in enumerate(path)), path))
    scored.sort(reverse=True)
    return {path for _, path in scored[:budget]}


def _token_paths(tree: Tree) -> list[tuple[int, ...]]:
    return [tuple(tree.tokens[tree.path(i)[1:]].tolist()) for i in range(1, tree.num_nodes)]


@pytest.mark.parametrize("seed", range(6))
def test_build_ddtree_selects_the_brute_force_top_paths(seed):
    g = torch.Generator().manual_seed(seed)
    L, V = 1 + seed % 5, 2 + (seed * 3) % 5                                   # L in 1..5, V in 2..6
    logits = 1.5 * torch.randn(L, V, generator=g, dtype=torch.float64)      # continuous: no ties
    logp = torch.log_softmax(logits, -1)
    for budget in range(1, 21):
        tree = build_ddtree(3, logits, budget)
        paths = _token_paths(tree)
        assert tree.num_nodes == min(budget, sum(V ** d for d in range(1, L + 1))) + 1
        assert set(paths) == _brute_force_top_paths(logp, budget), (L, V, budget)
        assert len(set(paths)) == len(paths)
        assert tree.tokens[0] == 3 and all(int(p) < i for i, p in enumerate(tree.parents.tolist()) if i)
        expected_lp = [float(logp[len(p) - 1, p[-1]]) for p in paths]
        assert tree.draft_logprobs[1:].tolist() == pytest.approx(expected_lp, abs=1e-12)


def test_build_ddtree_corner_cases():
    logits = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0]])
    assert build_ddtree(4, logits, 0).num_nodes == 1
    assert build_ddtree(4, logits[:0], 5).num_nodes == 1
    # equal log-probs: lower token id first, shallower/lexicographically smaller rank path first
    t = build_ddtree(4, logits, 3)
    assert t.tokens.tolist() == [4, 0, 1, 1] and t.parents.tolist() == [-1, 0, 0, 1]
    assert torch.equal(build_ddtree(4, logits, 5).tokens, build_ddtree(4, logits, 5).tokens)
    # zero-probability tokens are never placed, so the space runs out at 2 + 2 * 2 paths
    masked = torch.tensor([[0.0, float("-inf"), 1.0], [float("-inf"), 0.0, 0.5]])
    t = build_ddtree(4, masked, 20)
    assert t.num_nodes == 7 and torch.isfinite(t.draft_logprobs).all()
    assert set(t.tokens[1:].tolist()) == {0, 1, 2} and 1 not in t.tokens[t.depths == 1].tolist()
    with pytest.raises(ValueError, match="budget must be >= 0"):
        build_ddtree(4, logits, -2)
    with pytest.raises(ValueError, match="draft_logits hold NaN"):
        build_ddtree(4, torch.tensor([[0.0, float("nan"), 1.0]]), 2)


def test_top_k_stable_equals_the_first_k_of_a_stable_sort():
    """The DDTree's candidate ranks: equal to a full stable descending sort cut at k, on rows full of ties (values
    on a coarse grid), with -inf entries, and for k at and beyond the row length."""
    from tfm_runtime.tree import top_k_stable
    g = torch.Generator().manual_seed(0)
    for L, V, k in [(3, 50, 1), (4, 50, 7), (2, 9, 9), (2, 9, 20), (5, 300, 40)]:
        x = torch.randint(0, 6, (L, V), generator=g).double()                        # many ties
        x[x == 0] = float("-inf")
        want_v, want_i = x.sort(dim=-1, descending=True, stable=True)
        v, i = top_k_stable(x, k)
        assert i == want_i[:, :k].tolist() and v == want_v[:, :k].tolist(), (L, V, k)
