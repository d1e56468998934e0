"""Each group's distinct candidate ids (its union) and every candidate's index in it, through a bitmap (Triton).

For groups of G consecutive query rows of cand [M, Kc]:

    bits[g, w]   bit b set  <=>  id 32 w + b is a valid candidate of a row of group g     (`union_mark_kernel`)
    base[g, w]   = number of set bits of bits[g, :w]                                       (`union_list_kernel`)
    union[g, :]  = the set ids in increasing order, then -1;  count[g] = how many
    pos[m, c]    = base[g, w] + set bits of bits[g, w] below b, for id = cand[m, c] = 32 w + b (`union_pos_kernel`)

No sort and no host sync: the bitmap is ceil(vocab / 32) words per group (8 MB for 256 groups of the Qwen3.6-27B
vocabulary), every size is known on the host beforehand, so a training step can run ahead of the GPU.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _popcount(x):
    """Set bits of each uint32 of x (SWAR: pairs, nibbles, then a multiply that adds the bytes)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def union_mark_kernel(cand, bits, Kc, V, W, G: tl.constexpr, BK: tl.constexpr):
    """bits[m // G, id >> 5] |= 1 << (id & 31) for each valid id (0 <= id < V) of row m = program id.
    cand int [M, Kc]; bits int32 [groups, W], zeroed."""
    m = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BK)
    ids = tl.load(cand + m * Kc + o_c, mask=o_c < Kc, other=-1).to(tl.int64)
    ok = (ids >= 0) & (ids < V)
    ids = tl.where(ok, ids, 0)
    bit = (tl.full([BK], 1, tl.uint32) << (ids & 31).to(tl.uint32)).to(tl.int32, bitcast=True)
    tl.atomic_or(bits + (m // G) * W + (ids >> 5), bit, mask=ok, sem="relaxed")


@triton.jit
def union_list_kernel(bits, base, union, count, W, U, BW: tl.constexpr):
    """Group g = program id: base[g, w] (set bits before word w), union[g, :count[g]] (the set ids, increasing)
    and count[g]. bits, base int32 [groups, W]; union int64 [groups, U], -1 beforehand (entries from count on
    are left so); count int32 [groups]."""
    g = tl.program_id(0).to(tl.int64)
    run = tl.zeros([], dtype=tl.int32)                                     # set bits before this block
    for w0 in range(0, W, BW):
        o_w = w0 + tl.arange(0, BW)
        x = tl.load(bits + g * W + o_w, mask=o_w < W, other=0).to(tl.uint32, bitcast=True)     # [BW]
        n = _popcount(x)
        start = run + tl.cumsum(n, 0) - n                                   # exclusive prefix sum
        tl.store(base + g * W + o_w, start, mask=o_w < W)
        for b in tl.static_range(32):
            below = _popcount(x & ((1 << b) - 1))
            tl.store(union + g * U + start + below, o_w.to(tl.int64) * 32 + b, mask=((x >> b) & 1) != 0)
        run += tl.sum(n, 0)
    tl.store(count + g, run)


@triton.jit
def union_pos_kernel(cand, bits, base, pos, Kc, V, W, G: tl.constexpr, BK: tl.constexpr):
    """pos[m, c] = index of cand[m, c] in its group's union (-1 for ids outside [0, V)), row m = program id.
    pos int32 [M, Kc]."""
    m = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BK)
    ids = tl.load(cand + m * Kc + o_c, mask=o_c < Kc, other=-1).to(tl.int64)
    ok = (ids >= 0) & (ids < V)
    ids = tl.where(ok, ids, 0)
    word = (m // G) * W + (ids >> 5)
    x = tl.load(bits + word, mask=ok, other=0).to(tl.uint32, bitcast=True)
    below = _popcount(x & ((tl.full([BK], 1, tl.uint32) << (ids & 31).to(tl.uint32)) - 1))
    p = tl.load(base + word, mask=ok, other=0) + below
    tl.store(pos + m * Kc + o_c, tl.where(ok, p, -1), mask=o_c < Kc)


def group_union(cand: torch.Tensor, group: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct candidate ids of each group of `group` consecutive rows, without a sort or a host sync.

    cand int [M, Kc] (ids < 0 or >= vocab are pads) -> union int64 [ceil(M / group), U] with U = min(group, M) * Kc,
    the most a group can hold (its distinct ids in increasing order, then -1), pos int32 [M, Kc] (index of
    cand[m, c] in its group's union, -1 at pads) and count int32 [groups] (distinct ids per group).
    """
    M, Kc = cand.shape
    NG, U, W = triton.cdiv(M, group), min(group, M) * Kc, triton.cdiv(vocab, 32)
    BK = max(16, triton.next_power_of_2(Kc))
    cand = cand.contiguous()
    bits = torch.zeros(NG, W, dtype=torch.int32, device=cand.device)
    base = torch.empty(NG, W, dtype=torch.int32, device=cand.device)
    union = torch.full((NG, U), -1, dtype=torch.int64, device=cand.device)
    count = torch.empty(NG, dtype=torch.int32, device=cand.device)
    pos = torch.empty(M, Kc, dtype=torch.int32, device=cand.device)
    union_mark_kernel[(M,)](cand, bits, Kc, vocab, W, G=group, BK=BK, num_warps=4)
    union_list_kernel[(NG,)](bits, base, union, count, W, U, BW=1024, num_warps=8)
    union_pos_kernel[(M,)](cand, bits, base, pos, Kc, vocab, W, G=group, BK=BK, num_warps=4)
    return union, pos, count
