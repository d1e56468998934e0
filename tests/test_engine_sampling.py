"""At T=1 the joint distribution of the first 3 generated tokens under speculative decoding equals plain
sampling from the target (chi-square against the exact distribution), for target-only and traversal
verification, on a tiny target with a 16-token vocabulary (so that draft trees are often accepted)."""
import itertools

import pytest
import torch
from scipy.stats import chisquare

from tfm_runtime.engine import SpeculativeDecoder
from tfm_runtime.worlds import tiny_world

V, PROMPT, DRAWS = 16, [3, 9, 11, 4], 600


@pytest.fixture(scope="module")
def world():
    w = tiny_world("llama", vocab_size=V, dtype=torch.float64, candidate_pool=V, seed=3)
    with torch.no_grad():                           # sharpen the target so a few thousand draws have power
        w.target.lm_head_weight.mul_(16.0)
    return w


def exact_joint(world, temperature: float = 1.0) -> torch.Tensor:
    """p(x1, x2, x3 | prompt) at `temperature` by enumeration over the vocabulary (batched forwards) -> [V, V, V]."""
    t = world.target
    prompt = torch.tensor(PROMPT)

    def probs(seq):
        return torch.softmax(t(seq).logits[:, -1] / temperature, -1)

    with torch.no_grad():
        p1 = probs(prompt[None])[0]                                                               # [V]
        seq2 = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)
        p2 = probs(seq2)                                                                          # [V, V]
        pairs = torch.tensor(list(itertools.product(range(V), range(V))))
        seq3 = torch.cat([prompt.expand(V * V, -1), pairs], 1)
        p3 = probs(seq3).view(V, V, V)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint


def chi2_pvalue(samples: list[tuple[int, int, int]], joint: torch.Tensor) -> float:
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for a, b, c in samples:
        counts[(a * V + b) * V + c] += 1
    expected = joint.flatten() * len(samples)
    big = expected >= 5                              # pool the cells with small expected counts
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    assert big.sum() >= 15, "the test needs a spread-out distribution to have power"
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("proposal,verification", [("ddtree", "target_only"), ("weaver", "traversal")])
def test_first_three_tokens_match_target(world, proposal, verification):
    joint = exact_joint(world)
    dec = SpeculativeDecoder(world.target, world.drafter, world.weaver if proposal == "weaver" else None,
                             tree_budget=16, proposal=proposal, verification=verification, width=4)
    gen = torch.Generator().manual_seed(1234)
    samples, accepted = [], 0
    for _ in range(DRAWS):
        out = dec.generate(PROMPT, max_new_tokens=3, temperature=1.0, generator=gen)
        samples.append(tuple(out.tokens))
        accepted += sum(a - 1 for a in out.stats.accept_lengths)
    assert accepted > DRAWS // 4, "drafts were rarely accepted: the test would not exercise verification"
    assert chi2_pvalue(samples, joint) > 1e-3


def test_chi2_detects_a_wrong_sampler(world):
    """Teeth: DRAWS samples of the joint at T=1.5 instead of 1.0 must be rejected by the same statistic."""
    joint, wrong = exact_joint(world), exact_joint(world, temperature=1.5)
    idx = torch.multinomial(wrong.flatten(), DRAWS, replacement=True, generator=torch.Generator().manual_seed(99))
    samples = [(int(i) // (V * V), int(i) // V % V, int(i) % V) for i in idx]
    assert chi2_pvalue(samples, joint) < 1e-3
