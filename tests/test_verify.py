"""Verification rules: exact distributions by enumeration (float64, 1e-10), a Monte-Carlo chi-square of the
public traversal wrapper, and the target filter."""
from collections import defaultdict

import numpy as np
import pytest
import torch
from scipy import stats

from enumerate_tree import (emitted, enumerate_draws, exact_target_only, exact_traversal, max_deviation,
                            target_distribution)
from tfm_runtime import verify
from tfm_runtime.sampling import filter_probs, sample_from_uniform
from tfm_runtime.tree import Tree, build_ddtree
from tfm_runtime.verify import (verify_chain_sampling, verify_chain_sampling_with, verify_greedy,
                                verify_target_only, verify_target_only_with, verify_traversal,
                                verify_traversal_with)

TOL = 1e-10
_REJECT_CHILD = verify._reject_child


def _random_row(g: np.random.Generator, V: int, one_hot: bool = False) -> np.ndarray:
    """A distribution over V tokens with some exact zeros (at least one token kept)."""
    if one_hot:
        return np.eye(V)[g.integers(V)]
    row = g.dirichlet(np.full(V, 0.7)) * (g.random(V) > 0.3)
    if row.sum() == 0:
        row[g.integers(V)] = 1.0
    return row / row.sum()


def random_case(seed: int, max_nodes: int = 7, max_vocab: int = 5):
    """A random tree (distinct sibling tokens, root token outside the vocabulary), target rows [N, V] with
    zeros and occasional one-hot rows, and random draft log-probs."""
    g = np.random.default_rng(seed)
    V, n = int(g.integers(2, max_vocab + 1)), int(g.integers(2, max_nodes + 1))
    tokens, parents, depths, kids = [V + 3], [-1], [0], [[]]
    for i in range(1, n):
        parent = int(g.choice([p for p in range(i) if len(kids[p]) < V]))
        token = int(g.choice([t for t in range(V) if t not in {tokens[c] for c in kids[parent]}]))
        tokens.append(token), parents.append(parent), depths.append(depths[parent] + 1), kids.append([])
        kids[parent].append(i)
    logq = np.concatenate([[0.0], 1.5 * g.standard_normal(n - 1)])
    tree = Tree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
                draft_logprobs=torch.tensor(logq))
    target = torch.tensor(np.stack([_random_row(g, V, one_hot=g.random() < 0.1) for _ in range(n)]))
    return tree, target


def hand_cases():
    """Named corner cases: q = delta chains, a full star, the root alone, zero target mass on children,
    and a residual that depends on alpha."""
    g = np.random.default_rng(1234)
    chain = Tree.chain([9, 0, 2, 1, 1])                               # every proposal is a delta
    star = Tree(tokens=torch.tensor([9, 0, 1, 2]), parents=torch.tensor([-1, 0, 0, 0]),
                depths=torch.tensor([0, 1, 1, 1]), draft_logprobs=torch.log(torch.tensor([1.0, 0.5, 0.3, 0.2])))
    miss = Tree.chain([9, 1, 1], [0.0, -0.1, -0.2])
    # alpha(node 1) = 0.5 and q(0|1) = 0.5 lies between alpha p(0|1) = 0.35 and p(0|1) = 0.7: the residual
    # after rejecting node 2 depends on alpha.
    scaled = Tree(tokens=torch.tensor([9, 0, 0, 1]), parents=torch.tensor([-1, 0, 1, 1]),
                  depths=torch.tensor([0, 1, 2, 2]), draft_logprobs=torch.log(torch.tensor([1.0, 1.0, 0.5, 0.5])))
    scaled_target = torch.tensor([[0.5, 0.3, 0.2], [0.7, 0.1, 0.2], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]],
                                 dtype=torch.float64)
    return {
        "delta-chain": (chain, torch.tensor(np.stack([_random_row(g, 3) for _ in range(5)]))),
        "full-star": (star, torch.tensor(np.stack([_random_row(g, 3) for _ in range(4)]))),
        "root-only": (Tree.chain([9]), torch.tensor([[0.25, 0.0, 0.75]], dtype=torch.float64)),
        "zero-on-children": (miss, torch.tensor([[0.5, 0.0, 0.5], [0.0, 0.0, 1.0], [0.3, 0.7, 0.0]],
                                                dtype=torch.float64)),
        "alpha-scaled-residual": (scaled, scaled_target),
    }


CASES = [pytest.param(*random_case(s), id=f"seed{s}") for s in range(24)]
CASES += [pytest.param(*case, id=name) for name, case in hand_cases().items()]


@pytest.mark.parametrize("tree, target", CASES)
def test_target_only_is_exact(tree, target):
    actual = exact_target_only(verify_target_only_with, tree, target)
    assert max_deviation(actual, target_distribution(tree, target)) < TOL


@pytest.mark.parametrize("tree, target", CASES)
def test_traversal_is_exact(tree, target):
    actual = exact_traversal(verify_traversal_with, tree, target)
    assert max_deviation(actual, target_distribution(tree, target)) < TOL


def _wrong_norm_s(row, proposal, alpha, token):
    """The non-lossless variant of docs/method.md §5.5: alpha' = S / (1 - q(rejected))."""
    residual = (alpha * row - proposal).clamp_min(0.0)
    S, norm_s = float(residual.sum()), 1.0 - float(proposal[token])
    rest = proposal.clone()
    rest[token] = 0.0
    rest = rest / rest.sum() if rest.sum() > 0 else rest
    return (residual / S if S > 0 else residual), rest, (S / norm_s if norm_s > 0 else 0.0)


def _wrong_token_level_residual(row, proposal, alpha, token):
    """The token-level RRS residual norm((p - q)_+), ignoring the path acceptance alpha."""
    token_level_row, _, _ = _REJECT_CHILD(row, proposal, 1.0, token)
    _, rest, new_alpha = _REJECT_CHILD(row, proposal, alpha, token)
    return token_level_row, rest, new_alpha


def _wrong_keeps_rejected_proposal(row, proposal, alpha, token):
    """Forgets the without-replacement update: the rejected child keeps its proposal mass."""
    new_row, _, new_alpha = _REJECT_CHILD(row, proposal, alpha, token)
    return new_row, proposal, new_alpha


@pytest.mark.parametrize("wrong", [_wrong_norm_s, _wrong_token_level_residual, _wrong_keeps_rejected_proposal],
                         ids=["norm_s", "token_level_residual", "with_replacement"])
def test_wrong_traversal_update_fails_the_exact_test(wrong, monkeypatch):
    """Mutants of the rejection update, run inside the real verifier, must fail the exact test."""
    monkeypatch.setattr(verify, "_reject_child", wrong)
    deviations = [max_deviation(exact_traversal(verify_traversal_with, t, p), target_distribution(t, p))
                  for t, p in (case.values for case in CASES)]
    assert max(deviations) > 1e-3, deviations


def _chain_world(seed: int):
    """A context-dependent target p(.|prefix) and drafter q(.|prefix) (q one-hot at times), memoised."""
    g = np.random.default_rng(seed)
    V, n, root = int(g.integers(2, 5)), int(g.integers(1, 4)), 7
    cache = {}

    def dist(kind: int, prefix: tuple) -> np.ndarray:
        if (kind, prefix) not in cache:
            h = np.random.default_rng([seed, kind, *prefix])
            cache[kind, prefix] = _random_row(h, V, one_hot=kind == 1 and h.random() < 0.3)
        return cache[kind, prefix]

    return V, n, root, (lambda prefix: dist(0, prefix)), (lambda prefix: dist(1, prefix))


def _complete(dist: dict, p, length: int) -> dict:
    """Extend every emitted sequence to `length` tokens by sampling the target after it."""
    out = defaultdict(float)

    def grow(seq, mass):
        if len(seq) == length:
            out[seq] += mass
            return
        for y, py in enumerate(p(seq)):
            if py > 0:
                grow(seq + (y,), mass * py)

    for seq, mass in dist.items():
        grow(seq, mass)
    return dict(out)


@pytest.mark.parametrize("seed", range(24))
def test_chain_sampling_is_exact(seed):
    """Over drafts drawn from q and every verifier decision, the emission followed by plain target sampling
    is distributed exactly as the target's own samples of the same length."""
    V, n, root, p, q = _chain_world(seed)
    emitted_dist = defaultdict(float)

    def drafts(prefix, mass):
        if len(prefix) == n:
            yield prefix, mass
            return
        for x, qx in enumerate(q(prefix)):
            if qx > 0:
                yield from drafts(prefix + (x,), mass * qx)

    for xs, w in drafts((), 1.0):
        tree = Tree.chain((root,) + xs)
        P = torch.tensor(np.stack([p(xs[:i]) for i in range(n + 1)]))
        Q = torch.tensor(np.stack([q(xs[:i]) for i in range(n)] + [np.zeros(V)]))
        run = lambda draw: emitted(tree, verify_chain_sampling_with(tree, P, Q, draw))  # noqa: E731
        for seq, m in enumerate_draws(run, n + 1).items():
            emitted_dist[seq] += w * m
    expected = _complete({(): 1.0}, p, n + 1)
    assert max_deviation(_complete(emitted_dist, p, n + 1), expected) < TOL


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; outcomes of expected count < 5 are pooled. Impossible outcomes fail."""
    assert counts[probs <= 0].sum() == 0, "an outcome of probability 0 was emitted"
    expected = probs * counts.sum()
    big, small = expected >= 5, (expected < 5) & (probs > 0)
    obs, exp = list(counts[big]), list(expected[big])
    if small.any():
        obs.append(counts[small].sum()), exp.append(expected[small].sum())
    return float(stats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue)


def _chi_square_case(seed: int):
    """A DDTree of 40 draft nodes over V >= 50 and a target close to the drafter (top-k filtered)."""
    g = torch.Generator().manual_seed(seed)
    L, V = 5, 50 + 3 * seed
    draft_logits = 2.0 * torch.randn(L, V, generator=g, dtype=torch.float64)
    tree = build_ddtree(1, draft_logits, 40)
    next_depth = tree.depths.clamp(max=L - 1)
    target_logits = draft_logits[next_depth] + 0.7 * torch.randn(tree.num_nodes, V, generator=g, dtype=torch.float64)
    return tree, filter_probs(target_logits, 1.0, top_k=25), g


def _target_statistics(tree, P):
    """Exact law under the target of (a) the last accepted node, (b) the first emitted token."""
    tokens, parents, P = tree.tokens.tolist(), tree.parents.tolist(), P.numpy()
    reach = np.ones(tree.num_nodes)                     # P(the target's sample passes through the node)
    for i in range(1, tree.num_nodes):
        reach[i] = reach[parents[i]] * P[parents[i], tokens[i]]
    stop = np.array([1.0 - sum(P[i, tokens[c]] for c in tree.children(i)) for i in range(tree.num_nodes)])
    return reach * stop, P[0]


def _chi_square_pvalues(seed: int, draws: int) -> tuple[float, float]:
    """p-values of the last accepted node and of the first emitted token over `draws` public calls."""
    tree, P, g = _chi_square_case(seed)
    assert tree.num_nodes >= 30 and P.shape[1] >= 50
    last_law, first_law = _target_statistics(tree, P)
    last, first = np.zeros(tree.num_nodes), np.zeros(P.shape[1])
    for _ in range(draws):
        accepted, bonus = verify_traversal(tree, P, g)
        last[accepted[-1]] += 1
        first[emitted(tree, (accepted, bonus))[0]] += 1
    assert last[1:].sum() > draws / 4, "trees too shallow for the test to have power"
    return _chi2_pvalue(last, last_law), _chi2_pvalue(first, first_law)


CHI2_DRAWS, CHI2_SEEDS = 800, 10
CHI2_THRESHOLD = 1e-3 / (2 * CHI2_SEEDS)           # Bonferroni over 2 statistics x 10 seeds


def test_traversal_chi_square():
    """The public wrapper (Gumbel sibling keys, uniforms from the generator) against the exact target law."""
    for seed in range(CHI2_SEEDS):
        assert min(_chi_square_pvalues(seed, CHI2_DRAWS)) > CHI2_THRESHOLD, seed


def test_traversal_chi_square_detects_a_wrong_sibling_order(monkeypatch):
    """The exact tests supply sibling keys themselves; this shows the chi-square test sees key bugs."""
    right = verify.gumbel_keys
    monkeypatch.setattr(verify, "gumbel_keys", lambda logq, u: right(-logq, u))
    assert min(_chi_square_pvalues(0, CHI2_DRAWS)) < CHI2_THRESHOLD


def test_gumbel_keys_sample_plackett_luce_orders():
    q = [0.6, 0.3, 0.1]
    u = torch.rand(20000, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    keys = verify.gumbel_keys(torch.tensor(q).log().expand(20000, 3), u)
    orders = [tuple(o) for o in keys.argsort(-1, descending=True).tolist()]
    perms = sorted(set(orders))
    law = np.array([q[a] * q[b] / (1 - q[a]) for a, b, _ in perms])      # Plackett-Luce
    assert len(perms) == 6
    assert _chi2_pvalue(np.array([orders.count(o) for o in perms]), law) > 1e-3


def test_public_verifiers_are_reproducible():
    tree, P = random_case(3)
    for fn in (verify_target_only, verify_traversal):
        runs = [[fn(tree, P, g) for _ in range(5)] for g in (torch.Generator().manual_seed(7) for _ in range(2))]
        assert runs[0] == runs[1]


def test_verify_greedy():
    tree = Tree(tokens=torch.tensor([9, 2, 0, 1, 1]), parents=torch.tensor([-1, 0, 0, 1, 2]),
                depths=torch.tensor([0, 1, 1, 2, 2]), draft_logprobs=torch.zeros(5))
    logits = torch.tensor([[1.0, 0, 1], [0, 1, 0], [0, 0, 0], [0, 0, 5], [0, 0, 0]])
    # root: tie 0 / 2 -> token 0 (node 2); node 2: all tied -> token 0, no such child -> bonus 0
    assert verify_greedy(tree, logits) == ([0, 2], 0)
    logits[0, 2] = 2.0
    assert verify_greedy(tree, logits) == ([0, 1, 3], 2)


def test_verifiers_reject_bad_inputs():
    tree, P = random_case(5)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        verify_target_only(tree, P[:-1])
    with pytest.raises(ValueError, match="vocabulary size"):
        verify_traversal(tree, P[:, :1])
    with pytest.raises(ValueError, match="needs a chain"):
        verify_chain_sampling(Tree(tokens=torch.tensor([9, 0, 1]), parents=torch.tensor([-1, 0, 0]),
                                   depths=torch.tensor([0, 1, 1]), draft_logprobs=torch.zeros(3)),
                              torch.full((3, 2), 0.5), torch.full((3, 2), 0.5))
    with pytest.raises(ValueError, match="probability 0"):
        verify_chain_sampling(Tree.chain([9, 1]), torch.full((2, 2), 0.5), torch.tensor([[1.0, 0.0], [0, 0]]))
    bad = Tree.chain([9, 1], [0.0, float("-inf")])
    with pytest.raises(ValueError, match="finite draft_logprobs"):
        verify_traversal(bad, torch.full((2, 2), 0.5))


# ---- target filtering and inverse-CDF sampling -------------------------------------------------------

def test_filter_probs_greedy_is_one_hot_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    out = filter_probs(logits, 0.0, top_k=1, top_p=0.1, dtype=torch.float64)
    assert out.dtype == torch.float64
    assert out.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_filter_probs_temperature_top_k_top_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = probs.log() * 2.0                                   # temperature 2 undoes the factor
    torch.testing.assert_close(filter_probs(logits, 2.0), probs, rtol=0, atol=1e-15)
    assert filter_probs(logits, 2.0, top_k=2).tolist() == pytest.approx([0.625, 0.375, 0, 0], abs=1e-15)
    assert (filter_probs(logits, 2.0, top_p=0.45) > 0).tolist() == [True, False, False, False]
    assert (filter_probs(logits, 2.0, top_p=0.7) > 0).tolist() == [True, True, False, False]
    assert (filter_probs(logits, 2.0, top_p=0.85) > 0).tolist() == [True, True, True, False]
    assert (filter_probs(logits, 2.0, top_p=1e-9) > 0).tolist() == [True, False, False, False]
    # top-p acts on the top-k-renormalised distribution: 0.625 >= 0.6 keeps one token (0.5 < 0.6 would keep two)
    assert (filter_probs(logits, 2.0, top_k=2, top_p=0.6) > 0).tolist() == [True, False, False, False]
    batch = filter_probs(torch.randn(2, 3, 7), 0.7, top_k=3, top_p=0.9)
    assert batch.shape == (2, 3, 7) and ((batch > 0).sum(-1) <= 3).all()
    torch.testing.assert_close(batch.sum(-1), torch.ones(2, 3))


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_filter_probs_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        filter_probs(torch.zeros(3), **{"temperature": 1.0, **kwargs})


def test_sample_from_uniform_cells():
    w = torch.tensor([0.0, 0.2, 0.0, 0.3, 0.5], dtype=torch.float64)
    for weights in (w, w.tolist(), 2 * w):
        assert [sample_from_uniform(weights, u) for u in (0.0, 0.19, 0.2, 0.49, 0.5, 0.999)] == [1, 1, 3, 3, 4, 4]
        assert sample_from_uniform(weights, 1.0 - 1e-17) == 4
    assert sample_from_uniform(torch.tensor([0.0, 1.0, 0.0]), 0.999999) == 1
    with pytest.raises(ValueError, match="total mass"):
        sample_from_uniform(torch.zeros(3), 0.5)
