"""Exact output distributions of the verifiers, by enumerating every random decision (no Monte Carlo).

The verifiers take their randomness as `draw(weights, slot)` calls (plus explicit sibling keys for
traversal). `enumerate_draws` treats the verifier as a black box: it replays it from the start with a growing
prefix of decisions; when the verifier asks for a decision beyond the prefix, the weights it passed are the
cells of that uniform, and the enumerator branches on every cell with positive width. Nothing about the
verification rule itself is re-implemented here, so a wrong rule cannot be mirrored by a wrong test.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from math import prod
from typing import Callable, Hashable

import torch

from tfm_runtime.sampling import sample_from_uniform
from tfm_runtime.tree import Tree


class _NeedDraw(Exception):
    def __init__(self, weights: torch.Tensor):
        self.weights = weights


def categorical_cells(weights) -> list[tuple[int, float, float]]:
    """weights [K] (tensor or list) -> (index, probability, midpoint uniform) for every cell of positive width."""
    weights = torch.as_tensor(weights, dtype=torch.float64).cpu()
    cdf = (weights.cumsum(0) / weights.sum()).tolist()
    cells, lower = [], 0.0
    for k, upper in enumerate(cdf):
        if upper > lower:
            cells.append((k, upper - lower, (lower + upper) / 2))
        lower = upper
    return cells


def enumerate_draws(run: Callable[[Callable], Hashable], num_slots: int) -> dict[Hashable, float]:
    """Exact distribution of run(draw) when every draw(weights, slot) uses its own independent uniform.

    Each slot may be consumed at most once per run and must lie in [0, num_slots). At every branch the
    witness uniform (the cell's midpoint) is pushed through the production inverse CDF and must land in the
    cell, so the uniform -> decision mapping is checked too.
    """
    out: dict[Hashable, float] = defaultdict(float)
    stack: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while stack:
        prefix, mass = stack.pop()
        used: list[int] = []

        def draw(weights: torch.Tensor, slot: int) -> int:
            assert 0 <= slot < num_slots and slot not in used, (slot, used)
            used.append(slot)
            if len(used) <= len(prefix):
                return prefix[len(used) - 1]
            raise _NeedDraw(weights)

        try:
            result = run(draw)
        except _NeedDraw as need:
            for k, p, u in categorical_cells(need.weights):
                if p > 1e-9:
                    assert sample_from_uniform(need.weights, u) == k
                stack.append((prefix + (k,), mass * p))
            continue
        assert len(used) == len(prefix), "the verifier returned before using all replayed decisions"
        out[result] += mass
    return dict(out)


def plackett_luce_keys(tree: Tree) -> list[tuple[torch.Tensor, float]]:
    """Every joint sibling order of the tree as (sibling_keys [N], probability), where each parent's order
    is a Plackett-Luce sample with weights softmax(draft_logprobs of its children)."""
    groups = []
    for node in range(tree.num_nodes):
        kids = tree.children(node)
        if len(kids) < 2:
            continue
        w = dict(zip(kids, torch.softmax(tree.draft_logprobs[kids].to(torch.float64), 0).tolist()))
        options = []
        for order in itertools.permutations(kids):
            p = prod(w[c] / sum(w[d] for d in order[r:]) for r, c in enumerate(order))
            options.append((order, p))
        groups.append(options)
    out = []
    for choice in itertools.product(*groups):
        keys = torch.zeros(tree.num_nodes, dtype=torch.float64)
        for order, _ in choice:
            for rank, c in enumerate(order):
                keys[c] = len(order) - rank
        out.append((keys, prod(p for _, p in choice)))
    return out


def emitted(tree: Tree, result: tuple[list[int], int]) -> tuple[int, ...]:
    """(accepted, bonus) -> the emitted tokens: accepted tokens after the root, then the bonus."""
    accepted, bonus = result
    return tuple(tree.tokens[accepted[1:]].tolist()) + (int(bonus),)


def target_distribution(tree: Tree, target_probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """What the target itself emits: at node X every token y with p(y|X) > 0 either ends the emission (no
    child has token y) or continues into the child with token y."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    tokens = tree.tokens.tolist()

    def visit(node: int, prefix: tuple[int, ...], mass: float) -> None:
        child_of = {tokens[c]: c for c in tree.children(node)}
        row = target_probs[node].to(torch.float64)
        for y, p in enumerate((row / row.sum()).tolist()):
            if p > 0.0:
                if y in child_of:
                    visit(child_of[y], prefix + (y,), mass * p)
                else:
                    out[prefix + (y,)] += mass * p

    visit(0, (), 1.0)
    return dict(out)


def exact_target_only(verify_with, tree: Tree, target_probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    run = lambda draw: emitted(tree, verify_with(tree, target_probs, draw))  # noqa: E731
    return enumerate_draws(run, tree.num_nodes)


def exact_traversal(verify_with, tree: Tree, target_probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = defaultdict(float)
    for keys, p_order in plackett_luce_keys(tree):
        run = lambda draw: emitted(tree, verify_with(tree, target_probs, keys, draw))  # noqa: E731
        for seq, p in enumerate_draws(run, tree.num_nodes + 1).items():
            out[seq] += p_order * p
    return dict(out)


def max_deviation(actual: dict, expected: dict) -> float:
    """Largest |actual - expected| over the union of outcomes; both must sum to 1."""
    assert abs(sum(actual.values()) - 1.0) < 1e-12 and abs(sum(expected.values()) - 1.0) < 1e-12
    return max(abs(actual.get(k, 0.0) - expected.get(k, 0.0)) for k in actual.keys() | expected.keys())
