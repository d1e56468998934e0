"""Lossless verification of a proposal tree against the target (docs/method.md §5).

Every rule returns `(accepted, bonus)`: the accepted node indices from the root (root included) and the
token emitted after the last accepted node. The emitted tokens are tokens[accepted[1:]] + [bonus]; for the
sampling rules they are distributed exactly as if the target had sampled them one by one from
`target_probs` (the already filtered distribution after each node, see `sampling.filter_probs`).

Randomness is injectable. Every random decision is one call `draw(weights, slot)`, which returns index k
with probability weights[k] / sum(weights) using the uniform numbered `slot`; the traversal rule also takes
its sibling keys explicitly. The public functions build both from a torch.Generator
(`uniform_draw` over fresh uniforms, Gumbel keys); the `*_with` variants take them as arguments so that the
tests can replay and enumerate every decision. Uniform layout per call, N = tree.num_nodes:
    target-only     N       slot i: the target sample at node i
    chain sampling  N       slot i < N-1: accept test of node i+1; slot N-1: the residual or bonus sample
    traversal       2N + 1  N for the sibling keys; then slot s < N: accept test of step s; slot N: bonus

These are float64 reference implementations: one Python step per node, one V-vector operation per
rejection; `target_probs` may stay on the GPU.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from tfm_runtime.sampling import sample_from_uniform, uniforms
from tfm_runtime.tree import Tree

Draw = Callable[[torch.Tensor | list[float], int], int]


def uniform_draw(u: torch.Tensor) -> Draw:
    """u [S] uniforms in [0, 1) -> a Draw whose `slot` s uses u[s] (inverse CDF)."""
    u = u.tolist()
    return lambda weights, slot: sample_from_uniform(weights, u[slot])


def gumbel_keys(draft_logprobs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """draft_logprobs [N], u [N] uniforms -> keys [N] = log q - log(-log u). Sorting siblings by decreasing key
    draws their order from the Plackett-Luce (without-replacement) distribution with weights q."""
    return draft_logprobs.to(torch.float64).cpu() - torch.log(-torch.log(u.to(torch.float64)))


def _bernoulli(p: float) -> list[float]:
    """Cell weights [2] of an accept test: index 0 (accept) with probability p."""
    return [p, 1.0 - p]


def _check_rows(tree: Tree, rows: torch.Tensor, name: str) -> int:
    """Validate rows [N, V] against the tree; return V."""
    if rows.dim() != 2 or rows.shape[0] != tree.num_nodes:
        raise ValueError(f"{name} must be [N, V] with N = {tree.num_nodes} nodes, got shape {tuple(rows.shape)}")
    V = rows.shape[1]
    if tree.num_nodes > 1 and int(tree.tokens[1:].max()) >= V:
        raise ValueError(f"tree has draft token {int(tree.tokens[1:].max())} >= vocabulary size {V} of {name}")
    return V


def _child_with_token(tree: Tree, tokens: list[int], node: int, token: int) -> int | None:
    return next((c for c in tree.children(node) if tokens[c] == token), None)


def verify_greedy(tree: Tree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Follow the child whose token is the target's argmax; the bonus is the argmax at the last accepted node.

    Args: tree (N nodes); target_logits [N, V] (logits or probabilities: only the argmax is used; lowest id
    on ties).
    """
    _check_rows(tree, target_logits, "target_logits")
    return verify_greedy_best(tree, target_logits.argmax(-1))


def verify_greedy_best(tree: Tree, best: torch.Tensor) -> tuple[list[int], int]:
    """`verify_greedy` from the target's argmax per node, best [N] long (computed where the logits live, so that
    only N ids travel to the host)."""
    if best.shape != (tree.num_nodes,):
        raise ValueError(f"best must be [N] with N = {tree.num_nodes} nodes, got shape {tuple(best.shape)}")
    return greedy_path(tree.tokens.tolist(), tree.parents.tolist(), best.tolist())


def greedy_path(tokens: list[int], parents: list[int], best: list[int]) -> tuple[list[int], int]:
    """`verify_greedy_best` on plain lists (a tree's tokens and parents, node 0 the root, parents before children;
    best: the target's argmax per node), for a caller that validates its `Tree` later: the accepted node ids, root
    first, and the bonus token."""
    children: dict[tuple[int, int], int] = {}
    for i in range(len(tokens) - 1, 0, -1):               # the first child with a token wins, as in `Tree.children`
        children[(parents[i], tokens[i])] = i
    accepted = [0]
    while (child := children.get((accepted[-1], best[accepted[-1]]))) is not None:
        accepted.append(child)
    return accepted, best[accepted[-1]]


def verify_target_only(tree: Tree, target_probs: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Target-only ("naive") verification (docs/method.md §5.3); target_probs [N, V]. See `verify_target_only_with`."""
    return verify_target_only_with(tree, target_probs, uniform_draw(uniforms(tree.num_nodes, generator)))


def verify_target_only_with(tree: Tree, target_probs: torch.Tensor, draw: Draw) -> tuple[list[int], int]:
    """Sample y ~ p(.|current); move to the child with token y if there is one, else stop with bonus y.

    The output is literally a target sample path; the tree only decides how much of it comes for free.
    Args: tree (N nodes); target_probs [N, V]; draw (slot i = node i).
    """
    _check_rows(tree, target_probs, "target_probs")
    tokens, accepted = tree.tokens.tolist(), [0]
    while True:
        y = draw(target_probs[accepted[-1]], accepted[-1])
        child = _child_with_token(tree, tokens, accepted[-1], y)
        if child is None:
            return accepted, y
        accepted.append(child)


def verify_chain_sampling(tree: Tree, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                          generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Speculative sampling on a chain (docs/method.md §5.4); see `verify_chain_sampling_with`."""
    return verify_chain_sampling_with(tree, target_probs, draft_probs,
                                      uniform_draw(uniforms(tree.num_nodes, generator)))


def verify_chain_sampling_with(tree: Tree, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                               draw: Draw) -> tuple[list[int], int]:
    """Standard speculative sampling along a chain whose node i+1 was drawn from draft_probs[i].

    Args:
        tree: a chain of N nodes (ValueError otherwise).
        target_probs: [N, V] p(.|node i).
        draft_probs: [N, V] q(.|node i), the proposal node i+1 was drawn from (last row unused).
        draw: slot i < N-1 for the accept test of node i+1, slot N-1 for the closing sample.
    """
    _check_rows(tree, target_probs, "target_probs")
    _check_rows(tree, draft_probs, "draft_probs")
    if not tree.is_chain:
        raise ValueError(f"verify_chain_sampling needs a chain, got parents {tree.parents.tolist()}")
    tokens, n = tree.tokens.tolist(), tree.num_nodes
    for i in range(n - 1):
        p, q, x = _normalised(target_probs[i]), _normalised(draft_probs[i]), tokens[i + 1]    # p, q: [V]
        if not float(q[x]) > 0.0:
            raise ValueError(f"node {i + 1} has token {x}, which draft_probs[{i}] gives probability 0")
        # q(x) <= p(x): always accept; q(x) > p(x): accept with probability p(x) / q(x).
        if draw(_bernoulli(min(1.0, float(p[x] / q[x]))), i) == 1:
            # Rejected: resample from the residual norm(max(p - q, 0)). It has mass whenever a rejection
            # has positive probability; p stands in when p == q up to rounding.
            residual = (p - q).clamp_min(0.0)
            return list(range(i + 1)), draw(residual if float(residual.sum()) > 0.0 else p, n - 1)
    return list(range(n)), draw(target_probs[n - 1], n - 1)


def verify_traversal(tree: Tree, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Traversal Verification (docs/method.md §5.5); target_probs [N, V]. Sibling orders are drawn by Gumbel keys
    from q = softmax(draft_logprobs of the siblings). See `verify_traversal_with`."""
    n = tree.num_nodes
    u = uniforms(2 * n + 1, generator)
    return verify_traversal_with(tree, target_probs, gumbel_keys(tree.draft_logprobs, u[:n]), uniform_draw(u[n:]))


def verify_traversal_with(tree: Tree, target_probs: torch.Tensor, sibling_keys: torch.Tensor,
                          draw: Draw) -> tuple[list[int], int]:
    """Traversal Verification (Weng et al. 2025, Algorithm 3) with explicit randomness.

    Precondition: each node's children are the whole support of its proposal q = softmax(draft_logprobs of
    the children), and the sibling order (decreasing `sibling_keys`) is a Plackett-Luce sample from q.
    The tree is visited leaf to root in that order. alpha(node) is the probability that the whole path
    root..node is accepted; alpha(root) = 1, and alpha(c) = min(1, alpha(P) p(c|P) / q(c|P)) until a
    rejection among P's children changes P's target row, proposal and alpha (`_reject_child`).

    Args:
        tree: N nodes with finite draft_logprobs.
        target_probs: [N, V] p(.|node).
        sibling_keys: [N] sort keys; the root's is unused. Ties go to the lower node index.
        draw: slot s < N for the accept test of step s, slot N for the bonus.
    """
    V = _check_rows(tree, target_probs, "target_probs")
    n, tokens = tree.num_nodes, tree.tokens.tolist()
    if not bool(torch.isfinite(tree.draft_logprobs[1:]).all()):
        raise ValueError("traversal needs finite draft_logprobs: every child must have q > 0")
    keys, device = sibling_keys.tolist(), target_probs.device
    # q_at[c] = q(token c | parent) over the parent's remaining children; p_at[c] = p(token c | parent) under
    # the parent's current (possibly residual) target row. Index 0 (the root) is unused.
    q_at = _sibling_softmax(tree)
    mass = target_probs.sum(-1, dtype=torch.float64)                                          # [N]
    parent_of = tree.parents.clamp_min(0).to(device)                                          # [N]
    at = torch.tensor([0] + tokens[1:], device=device)                                        # [N]
    p_at = (target_probs[parent_of, at].to(torch.float64) / mass[parent_of]).tolist()
    rows: dict[int, torch.Tensor] = {}        # node -> [V] residual target row, once it rejected a child
    proposals: dict[int, torch.Tensor] = {}   # node -> [V] q over its remaining children, idem
    kid_tokens: dict[int, torch.Tensor] = {}  # node -> [k] its children's tokens, idem
    reset_alpha = {0: 1.0}                    # node -> alpha set by a rejection among its children
    active = [True] * n

    for step in range(n):
        # The first leaf in the sibling order: from the root, take the active child with the largest key.
        path, alphas = [0], [reset_alpha[0]]
        while kids := [c for c in tree.children(path[-1]) if active[c]]:
            c = max(kids, key=keys.__getitem__)
            alphas.append(reset_alpha.get(c, _extend(alphas[-1], p_at[c], q_at[c])))
            path.append(c)
        leaf = path[-1]
        if leaf == 0 or draw(_bernoulli(alphas[-1]), step) == 0:
            row = rows.get(leaf, target_probs[leaf])
            # An all-zero residual is reachable only through rounding (p == q at the root): use p.
            return path, draw(row if float(row.sum()) > 0.0 else target_probs[leaf], n)
        parent, kids = path[-2], tree.children(path[-2])
        if parent not in rows:
            kid_tokens[parent] = at = torch.tensor([tokens[c] for c in kids], device=device)
            rows[parent] = target_probs[parent].to(torch.float64) / mass[parent]
            proposals[parent] = torch.zeros(V, dtype=torch.float64, device=device).index_put_(
                (at,), torch.tensor([q_at[c] for c in kids], dtype=torch.float64, device=device))
        rows[parent], proposals[parent], reset_alpha[parent] = _reject_child(
            rows[parent], proposals[parent], alphas[-2], tokens[leaf])
        active[leaf] = False
        # The siblings' p and q now come from the updated parent (stale values of rejected ones are unused).
        at = kid_tokens[parent]
        for c, p, q in zip(kids, rows[parent][at].tolist(), proposals[parent][at].tolist(), strict=True):
            p_at[c], q_at[c] = p, q
    raise AssertionError("unreachable: the root is accepted once it has no active children")


def _sibling_softmax(tree: Tree) -> list[float]:
    """[N] q of every node among its siblings: softmax of the siblings' draft_logprobs (root: 0)."""
    logq, q = tree.draft_logprobs.tolist(), [0.0] * tree.num_nodes
    for node in range(tree.num_nodes):
        if kids := tree.children(node):
            top = max(logq[c] for c in kids)
            w = [math.exp(logq[c] - top) for c in kids]
            for c, wc in zip(kids, w, strict=True):
                q[c] = wc / math.fsum(w)
    return q


def _extend(alpha: float, p: float, q: float) -> float:
    """alpha(child) = min(1, alpha(parent) p / q); a child whose q underflowed to 0 takes the q -> 0 limit."""
    if q > 0.0:
        return min(1.0, alpha * p / q)
    return 1.0 if alpha * p > 0.0 else 0.0


def _reject_child(row: torch.Tensor, proposal: torch.Tensor, alpha: float,
                  token: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Traversal update at a parent P whose child with `token` was just rejected.

    Args:
        row: [V] P's current target row (sums to 1).
        proposal: [V] q over P's remaining children, the rejected one included (sums to 1).
        alpha: P's current acceptance probability.
    Returns:
        row': [V] norm((alpha p - q)_+), the distribution of what P emits next given this rejection.
        proposal': [V] q without `token`, renormalised (sampling without replacement).
        alpha': S / (S + 1 - alpha) with S = sum((alpha p - q)_+). The child was rejected with probability
            sum((q - alpha p)_+) = S + 1 - alpha, and P must end up accepted with next token y with
            probability alpha p(y); solving gives alpha' (docs/method.md §5.5). It is 0 when S + 1 - alpha = 0.
    """
    residual = (alpha * row - proposal).clamp_min(0.0)
    S = float(residual.sum())
    proposal = proposal.clone()
    proposal[token] = 0.0
    left = float(proposal.sum())
    if left > 0.0:
        proposal /= left
    denom = S + 1.0 - alpha
    return (residual / S if S > 0.0 else residual), proposal, (S / denom if denom > 0.0 else 0.0)


def _normalised(row: torch.Tensor) -> torch.Tensor:
    """row [V] -> float64 row / row.sum()."""
    row = row.to(torch.float64)
    return row / row.sum()
