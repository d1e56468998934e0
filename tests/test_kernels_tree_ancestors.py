"""tfm_kernels.tree_ancestors against its torch reference and against Tree.ancestor_mask: random trees padded to a
row width (padding sees only itself), chains as deep as max_depth, parent rows that are views of wider rows, int32
and int64 parents. CPU runs use the Triton interpreter."""
import pytest
import torch

from tfm_kernels.tree_ancestors import ancestors_ref, tree_ancestors
from tfm_runtime.tree import Tree


def random_parents(g, n, width):
    """-> (parents [width] long, -1 past n; depths of the n nodes) of a random tree of n nodes."""
    par = torch.full((width,), -1)
    depth = [0] * n
    for i in range(1, n):
        par[i] = int(torch.randint(max(0, i - 4), i, (1,), generator=g))
        depth[i] = depth[int(par[i])] + 1
    return par, depth


def check(device):
    g = torch.Generator().manual_seed(0)
    for n, width in [(1, 1), (5, 8), (40, 65), (65, 65), (100, 129)]:
        rows, trees, deepest = [], [], 1
        for _ in range(3):
            par, depth = random_parents(g, n, width)
            rows.append(par)
            trees.append(Tree(tokens=torch.arange(n), parents=par[:n], depths=torch.tensor(depth),
                              draft_logprobs=torch.zeros(n, dtype=torch.float64)))
            deepest = max(deepest, max(depth))
        wide = torch.full((3, width + 7), 9)
        wide[:, :width] = torch.stack(rows)
        for dt in (torch.long, torch.int32):
            parents = wide.to(dt)[:, :width]                                                  # rows apart
            got = tree_ancestors(parents.to(device), deepest).cpu()
            assert torch.equal(got, ancestors_ref(parents.long(), deepest))
            for b, tree in enumerate(trees):
                assert torch.equal(got[b, :n, :n], tree.ancestor_mask())
                assert torch.equal(got[b, n:], torch.eye(width, dtype=torch.bool)[n:])
    chain = torch.arange(-1, 16)[None]                                                        # 17 nodes, depth 16
    assert torch.equal(tree_ancestors(chain.to(device), 16).cpu()[0], torch.ones(17, 17, dtype=torch.bool).tril())
    assert not tree_ancestors(chain.to(device), 15).cpu()[0, 16, 0]                           # one level short


@pytest.mark.interpreter
def test_equals_the_reference_and_the_tree_s():
    check("cpu")


@pytest.mark.gpu
def test_gpu_equals_the_reference_and_the_tree_s():
    check("cuda")


def test_rejects_bad_parents():
    with pytest.raises(ValueError, match="parents must be"):
        tree_ancestors(torch.zeros(2, 3, 4, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="parents must be"):
        tree_ancestors(torch.zeros(4, 3, dtype=torch.long).t(), 3)
