"""The Weaver build's frontier steps in one Triton launch each against their torch references
(tfm_kernels.weaver_frontier): every buffer they write equal. place: random frontiers with ties, invalid entries, a
budget that runs out, and the last round (nothing expands), the ranking it writes (`perm`) equal to torch's
stable sort; push: log q with ties, -inf and NaN, slots that do not expand, a step narrower than the frontier's
width (the root's), the children of each slot chosen as a stable sort orders them. CPU runs use the Triton
interpreter."""
import math

import pytest
import torch

from tfm_kernels.weaver_frontier import finish, finish_ref, place, place_ref, push, push_ref


def buffers(seed, B, N, W, E, R, filled):
    g = torch.Generator().manual_seed(seed)
    M, S, P = N + W * E, 1 + (R - 1) * W, 1 + R * W
    front_int = torch.stack([torch.randint(0, S, (B, M), generator=g), torch.randint(0, 50, (B, M), generator=g),
                             torch.randint(0, 6, (B, M), generator=g)], -1)                 # parent, token, depth
    score = torch.randint(-4, 1, (B, M), generator=g).double()                              # many ties
    score[torch.rand(B, M, generator=g) < 0.3] = -math.inf                                  # invalid entries
    front_flt = torch.stack([score, torch.randn(B, M, generator=g, dtype=torch.float64)], -1)
    perm = torch.randint(0, M, (B, M), generator=g)                                          # written by place
    slot_int, slot_flt = torch.randint(0, 9, (B, P, 3), generator=g), torch.randn(B, P, 2, generator=g).double()
    slot_placed = torch.rand(B, P, generator=g) < 0.5
    count = torch.tensor([filled, N + 1 - 1, N + 1][:B])                                    # room for all, 1, none
    visible = (torch.rand(B, S, 3 + S, generator=g) < 0.3)[:, :, 3:]                      # rows apart, as the builder's
    out = (torch.full((B, W), 7), torch.full((B, W), 7), torch.zeros(B, W).double(),
           torch.zeros(B, W, dtype=torch.bool), torch.full((B, W), 7))
    return [front_int, front_flt, perm, slot_int, slot_flt, slot_placed, count, visible, out]


def check(N, W, E, R, device):
    for seed in range(3):
        for r in range(1, R + 1):
            s0, expand = 1 + (r - 1) * W, r < R
            a, b = (buffers(seed * 100 + r, 3, N, W, E, R, filled=min(r, N)) for _ in range(2))
            b = [t.to(device) for t in b[:-1]] + [tuple(t.to(device) for t in b[-1])]
            place_ref(*a, s0=s0, budget=N, lookahead=5, expand=expand, rows_per_tree=6)
            place(*b, s0=s0, budget=N, lookahead=5, expand=expand, rows_per_tree=6)
            tok, dep, _, _, row = a[-1]                       # each slot's candidate row of its depth
            assert torch.equal(row, torch.arange(3)[:, None] * 6 + dep)
            for x, y in zip(a[:-1] + list(a[-1]), b[:-1] + list(b[-1])):
                assert torch.equal(x, y.cpu())


SHAPES = [(16, 1, 8, 16), (64, 4, 8, 16), (7, 3, 2, 5), (1, 1, 1, 1)]


@pytest.mark.interpreter
@pytest.mark.parametrize("N,W,E,R", SHAPES)
def test_place_equals_the_reference(N, W, E, R):
    check(N, W, E, R, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("N,W,E,R", SHAPES + [(128, 8, 8, 16)])
def test_gpu_place_equals_the_reference(N, W, E, R):
    check(N, W, E, R, "cuda")


def push_case(seed, B, N, Wd, W, E, K, device):
    g = torch.Generator().manual_seed(seed)
    M, R = N + Wd * E, 5
    front_int, front_flt = torch.randint(0, 9, (B, M, 3), generator=g), torch.randn(B, M, 2, generator=g).double()
    logq = (torch.randint(-6, 0, (B, W, K), generator=g) / 2).float()            # many equal values
    logq[torch.rand(B, W, K, generator=g) < 0.2] = -math.inf
    logq[0, 0, -1] = math.nan
    cand_ids = torch.randint(0, 1000, (R, K), generator=g)
    rows = torch.randint(0, R, (B, W), generator=g)
    dep, score = torch.randint(0, 6, (B, W), generator=g), -torch.rand(B, W, generator=g).double() * 5
    active = torch.rand(B, W, generator=g) < 0.7
    bufs = [front_int, front_flt, logq, cand_ids, rows, dep, active, score]
    return bufs, [t.clone().to(device) for t in bufs]


def check_push(device):
    for seed, (N, Wd, W, E, K) in enumerate([(16, 1, 1, 8, 12), (64, 4, 4, 8, 512), (64, 4, 1, 8, 16),
                                             (7, 3, 2, 2, 3), (1, 1, 1, 1, 1), (9, 2, 2, 5, 5)]):
        a, b = push_case(seed, 3, N, Wd, W, E, K, device)
        push_ref(*a, s0=5, budget=N, expand=E)
        push(*b, s0=5, budget=N, expand=E)
        for x, y in zip(a[:2], b[:2]):
            assert torch.equal(x.isnan(), y.isnan().cpu()) and torch.equal(x.nan_to_num(), y.nan_to_num().cpu())


def test_push_ref_takes_the_stable_top_e():
    """The reference's children: the E best log q of each slot, equal values in candidate order, NaN first."""
    a, _ = push_case(0, 1, 4, 1, 1, 3, 6, "cpu")
    a[2][0, 0] = torch.tensor([-1.0, 0.0, -1.0, math.nan, -math.inf, 0.0])
    a[6][:] = True
    push_ref(*a, s0=2, budget=4, expand=3)
    front_int, front_flt = a[0][0, 4:7], a[1][0, 4:7]
    assert front_int[:, 1].tolist() == a[3][a[4][0, 0], [3, 1, 5]].tolist()         # NaN, then the two 0.0
    assert front_flt[0, 0].item() == -math.inf and front_flt[1:, 1].tolist() == [0.0, 0.0]
    assert front_int[:, 0].tolist() == [2, 2, 2] and (front_int[:, 2] == a[5][0, 0] + 1).all()


@pytest.mark.interpreter
def test_push_equals_the_reference():
    check_push("cpu")


@pytest.mark.gpu
def test_gpu_push_equals_the_reference():
    check_push("cuda")


@pytest.mark.interpreter
def test_bad_buffers():
    bufs = buffers(0, 3, 8, 2, 4, 4, 1)
    with pytest.raises(ValueError, match="place expects"):
        place(*bufs, s0=1 + 3 * 2, budget=8, lookahead=5, expand=True, rows_per_tree=6)   # the last round expands
    bufs[7] = bufs[7].transpose(1, 2)
    with pytest.raises(ValueError, match="place expects"):
        place(*bufs, s0=1, budget=8, lookahead=5, expand=True, rows_per_tree=6)         # not contiguous
    bufs, _ = push_case(0, 2, 8, 2, 3, 4, 5, "cpu")                                    # 3 slots, room for 2
    with pytest.raises(ValueError, match="push expects"):
        push(*bufs, s0=1, budget=8, expand=4)
    bufs, _ = push_case(0, 2, 8, 2, 2, 4, 3, "cpu")                                    # 4 children of 3
    with pytest.raises(ValueError, match="push expects"):
        push(*bufs, s0=1, budget=8, expand=4)


def finish_case(seed, B, N, P, M, W, device="cpu"):
    """Random placement slots (slot 0 the root; each placed slot's parent an earlier placed slot; the unplaced ones
    garbage) and frontiers: tree 0 has entries left, tree 1 none, tree 2 every slot placed (when P > N)."""
    g = torch.Generator().manual_seed(seed)
    placed = torch.rand(B, P, generator=g) < 0.6
    placed[:, 0] = True
    placed &= placed.cumsum(1) <= N + 1                                                    # at most N + 1 nodes
    if B > 2:
        placed[2] = torch.arange(P) <= N                                                    # a full tree
    slot_int = torch.randint(-1, P, (B, P, 3), generator=g)
    for b in range(B):
        ids = placed[b].nonzero().flatten().tolist()
        for j, i in enumerate(ids):
            slot_int[b, i, 0] = -1 if j == 0 else ids[int(torch.randint(0, j, (1,), generator=g))]
    slot_flt = torch.randn(B, P, 2, generator=g, dtype=torch.float64)
    slot_flt[:, :, 1][torch.rand(B, P, generator=g) < 0.1] = -math.inf
    front_flt = torch.randn(B, M, 2, generator=g, dtype=torch.float64)
    front_flt[1, :, 0] = -math.inf                                                          # nothing left
    front_flt[0, : M // 2, 0] = -math.inf                                                   # only rows past N left
    last_active = torch.rand(B, W, generator=g) < 0.2
    outs = (torch.full((B, N + 2), 5), torch.full((B, N + 2), 5), torch.full((B, N + 2), 5),
            torch.full((B, N + 2), 5.0, dtype=torch.float64), torch.full((B,), 5), torch.ones(B, dtype=torch.bool))
    ins = (slot_int, slot_flt, placed, front_flt)
    return [t.to(device) for t in ins], last_active.to(device), tuple(t.to(device) for t in outs)


def check_finish(device):
    for seed, (N, P, M, W) in enumerate([(16, 41, 48, 4), (64, 97, 128, 8), (7, 5, 9, 2), (1, 2, 3, 1)]):
        for with_last in (False, True):
            ins, last, outs = finish_case(seed, 3, N, P, M, W)
            want = tuple(t.clone() for t in outs)
            finish_ref(*ins, last if with_last else None, want, budget=N)
            ins, last, outs = finish_case(seed, 3, N, P, M, W, device)
            finish(*ins, last if with_last else None, outs, budget=N)
            for x, y in zip(want[:4], outs[:4]):
                assert torch.equal(x[:, : N + 1], y[:, : N + 1].cpu())                      # column N+1: scratch
            assert torch.equal(want[4], outs[4].cpu()) and torch.equal(want[5], outs[5].cpu())
            if P > N:                                   # the full tree is not truncated, the empty frontier's
                assert want[4][2] == N + 1 and not want[5][2]
            assert not want[5][1] or with_last


@pytest.mark.interpreter
def test_finish_equals_the_reference():
    check_finish("cpu")


@pytest.mark.gpu
def test_gpu_finish_equals_the_reference():
    check_finish("cuda")


def test_finish_rejects_bad_buffers():
    ins, last, outs = finish_case(0, 3, 8, 9, 12, 2)
    with pytest.raises(ValueError, match="finish expects"):
        finish(*ins, None, (outs[0][:, :-1],) + outs[1:], budget=8)                        # node rows too short
    with pytest.raises(ValueError, match="finish expects"):
        finish(*ins, None, outs, budget=16)                                                 # budget > M
