"""tfm_kernels.greedy_accept against its reference and against the greedy verifier's own walk
(`tfm_runtime.verify.greedy_path`): random trees whose siblings repeat tokens (the first child wins), padding past
num_nodes that would match, paths cut at amax, held rows, rows that lie apart, bad input. CPU runs use the Triton
interpreter."""
import pytest
import torch

from tfm_kernels.greedy_accept import greedy_accept, greedy_accept_ref
from tfm_runtime.verify import greedy_path


def random_trees(B, n, vocab, g):
    """B random trees of n columns: parents before children, a small vocabulary (siblings repeat tokens), an argmax
    that follows a child often; each row's num_nodes in 1..n, with padding columns that would match if read."""
    tokens = torch.randint(0, vocab, (B, n), generator=g)
    parents = torch.full((B, n), -1, dtype=torch.long)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (B,), generator=g)
    best = torch.randint(0, vocab, (B, n), generator=g)
    num_nodes = torch.randint(1, n + 1, (B,), generator=g)
    num_nodes[0] = n
    for b in range(B):
        for i in range(1, n):                      # let many nodes continue: the argmax at the parent is their token
            if torch.rand((), generator=g) < 0.5:
                best[b, parents[b, i]] = tokens[b, i]
    return tokens, parents, best, num_nodes


def check(device):
    g = torch.Generator().manual_seed(0)
    for B, n, vocab, amax in [(1, 1, 3, 1), (3, 5, 2, 6), (4, 17, 3, 17), (2, 65, 4, 17), (5, 33, 2, 4),
                              (1, 129, 3, 33)]:
        tokens, parents, best, num_nodes = random_trees(B, n, vocab, g)
        want = greedy_accept_ref(tokens, parents, best, num_nodes, amax)
        for b in range(B):                          # the reference is the verifier's walk, cut at amax
            k = int(num_nodes[b])
            path, bonus = greedy_path(tokens[b, :k].tolist(), parents[b, :k].tolist(), best[b, :k].tolist())
            if len(path) <= amax:
                A = len(path)
                assert want[b, :A].tolist() == path and want[b, amax:].tolist() == [A, path[-1], bonus]
            else:
                assert want[b, :amax].tolist() == path[:amax] and int(want[b, amax]) == amax
        got = greedy_accept(*(t.to(device) for t in (tokens, parents, best, num_nodes)), amax)
        assert torch.equal(got.cpu(), want), (B, n, amax)
        hold = torch.arange(B) % 2 == 1
        want_held = greedy_accept_ref(tokens, parents, best, num_nodes, amax, hold)
        for b in range(B):
            if hold[b]:
                assert want_held[b].tolist() == [0] * amax + [0, -1, int(tokens[b, 0])]
            else:
                assert torch.equal(want_held[b], want[b])
        out = torch.full((B, amax + 3), 7, dtype=torch.long, device=device)
        wide = [torch.cat([t, torch.zeros(B, 3, dtype=torch.long)], 1).to(device)[:, :n]   # rows lie apart
                for t in (tokens, parents, best)]
        got = greedy_accept(*wide, num_nodes.to(device), amax, hold.to(device), out=out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(out.cpu(), want_held), (B, n, amax)


@pytest.mark.interpreter
def test_equals_the_reference():
    check("cpu")


@pytest.mark.gpu
def test_gpu_equals_the_reference():
    check("cuda")


def test_rejects_bad_input():
    t = torch.zeros(2, 4, dtype=torch.long)
    n = torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match="parents"):
        greedy_accept(t, t[:, :3], t, n, 4)
    with pytest.raises(ValueError, match="long tokens"):
        greedy_accept(t.int(), t.int(), t.int(), n, 4)
    with pytest.raises(ValueError, match="bool hold"):
        greedy_accept(t, t, t, n, 4, hold=n)
    with pytest.raises(ValueError, match="contiguous last dim"):
        greedy_accept(t, torch.zeros(4, 2, dtype=torch.long).t(), t, n, 4)
    with pytest.raises(ValueError, match="num_nodes and hold"):
        greedy_accept(t, t, t, n[:1], 4)
    with pytest.raises(ValueError, match="out"):
        greedy_accept(t, t, t, n, 4, out=torch.zeros(2, 6, dtype=torch.long))
