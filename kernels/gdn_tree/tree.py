"""Per-step tree metadata shared by every GDN layer: parent checks and ancestor bitmasks."""
import torch
import triton
import triton.language as tl

MAX_NODES = 256


def check_parents(parent, num_nodes):
    """Raise ValueError unless every real node's parent comes before it.

    parent[b, i] must satisfy -1 <= parent[b, i] < i for i < num_nodes[b] (-1 = reads the committed
    state; node 0 must have parent -1). Padding entries are ignored. This reads the tensors on the
    host (a device sync): call it outside CUDA-graph capture.
    """
    if parent.dim() != 2 or num_nodes.shape != parent.shape[:1]:
        raise ValueError(f"parent must be [B, N] and num_nodes [B], got {tuple(parent.shape)} "
                         f"and {tuple(num_nodes.shape)}")
    B, N = parent.shape
    p, n = parent.detach().cpu().long(), num_nodes.detach().cpu().long()
    if bool(((n < 0) | (n > N)).any()):
        raise ValueError(f"num_nodes must lie in [0, {N}], got {n.tolist()}")
    idx = torch.arange(N)
    real = idx[None, :] < n[:, None]
    bad = real & ((p >= idx[None, :]) | (p < -1))
    if bool(bad.any()):
        b, i = (int(t) for t in bad.nonzero()[0])
        raise ValueError(f"parents must be topological (-1 <= parent[b, i] < i): "
                         f"parent[{b}, {i}] = {int(p[b, i])}; permute the nodes first")


@triton.jit
def tree_ancestor_bits_kernel(parent, num_nodes, anc, jump, N: tl.constexpr, NW: tl.constexpr,
                              NP: tl.constexpr, NWP: tl.constexpr, LOG: tl.constexpr):
    # pointer doubling: after round r, row i holds i and its 2^r - 1 nearest ancestors
    i_b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_nodes + i_b)
    o_i = tl.arange(0, NP)
    o_w = tl.arange(0, NWP)
    m_i = o_i < n
    m_st = (o_i < N)[:, None] & (o_w < NW)[None, :]
    # [NP]
    b_j = tl.load(parent + i_b * N + o_i, mask=m_i, other=-1).to(tl.int32)
    b_j = tl.where(m_i & (b_j >= 0), b_j, -1)
    # [NP, NWP]
    b_bits = tl.where(m_i[:, None] & ((o_i // 32)[:, None] == o_w[None, :]),
                      (1 << (o_i % 32))[:, None], 0)
    p_bits = anc + (i_b * N + o_i[:, None]) * NW + o_w[None, :]
    tl.store(p_bits, b_bits, mask=m_st)
    tl.store(jump + i_b * NP + o_i, b_j)
    for _ in range(LOG):
        tl.debug_barrier()
        m_j = b_j >= 0
        b_pb = tl.load(anc + (i_b * N + b_j[:, None]) * NW + o_w[None, :],
                       mask=m_j[:, None] & (o_w < NW)[None, :], other=0)
        b_pj = tl.load(jump + i_b * NP + b_j, mask=m_j, other=-1)
        tl.debug_barrier()
        b_bits = b_bits | b_pb
        b_j = tl.where(m_j, b_pj, -1)
        tl.store(p_bits, b_bits, mask=m_st)
        tl.store(jump + i_b * NP + o_i, b_j)


def tree_ancestor_bits(parent, num_nodes, check=True):
    """Inclusive ancestor bitmask, built once per step and shared by all layers.

    Bit j % 32 of word anc[b, i, j // 32] is set iff node j lies on the path root..i
    (padding rows are all zero).

    Args:
        parent: [B, N] int32/int64, topological (see `check_parents`).
        num_nodes: [B] int32/int64, real nodes per request (n_b <= N <= 256).
        check: validate the parents on the host (syncs; pass False under CUDA-graph capture).
    Returns:
        anc: [B, N, ceil(N / 32)] int32.

    Example::
        >>> parent = torch.tensor([[-1, 0, 0, 1]]); n = torch.tensor([4])
        >>> tree_ancestor_bits(parent, n)[0, :, 0].tolist()
        [1, 3, 5, 11]
    """
    B, N = parent.shape
    if N > MAX_NODES:
        raise ValueError(f"at most {MAX_NODES} nodes per tree are supported, got N={N}")
    if check:
        check_parents(parent, num_nodes)
    NW = triton.cdiv(N, 32)
    NP = triton.next_power_of_2(N)
    anc = torch.empty(B, N, NW, dtype=torch.int32, device=parent.device)
    jump = torch.empty(B, NP, dtype=torch.int32, device=parent.device)
    tree_ancestor_bits_kernel[(B,)](
        parent.contiguous(), num_nodes.contiguous(), anc, jump, N=N, NW=NW, NP=NP,
        NWP=triton.next_power_of_2(NW), LOG=max(1, (NP - 1).bit_length()), num_warps=4)
    return anc


def ancestor_bits_to_mask(anc, N=None):
    """Expand [B, N, NW] int32 bits to a dense [B, N, N] bool mask (for tests and debugging)."""
    N = anc.shape[1] if N is None else N
    j = torch.arange(N, device=anc.device)
    words = anc[:, :, j // 32]
    return ((words >> (j % 32)) & 1).bool()
