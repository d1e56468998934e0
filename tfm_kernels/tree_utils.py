"""Tree encodings shared by the tree kernels (pure torch, graph-capturable, no host sync; only the
parent check `check_parents` reads on the host).

A batch of draft trees is `parent: int [B, N]` with `parent[b, 0] = -1` and
`0 <= parent[b, i] < i` for `1 <= i < num_nodes[b]` (topological order; a -1 past node 0
starts another tree of a forest); nodes `>= num_nodes[b]` are padding. From it we derive, once
per step, the inclusive ancestor relation
(`anc[b, i, j]` is True iff node j lies on the path root..i, i itself included) either as a bool
matrix `[B, N, N]` or packed into 32-bit words `[B, N, ceil(N / 32)]` (bit `j % 32` of word
`j // 32`), plus the depth of every node (root = 0). Padding rows are empty (all False / 0).
"""
import torch

WORD_BITS = 32


def check_parents(parent: torch.Tensor, num_nodes: torch.Tensor | None = None) -> bool:
    """Raise ValueError unless every real node's parent comes before it; return whether node 0 is an
    ancestor of every real node of every request (only node 0 has parent -1: a single tree).

    parent [B, N] must satisfy -1 <= parent[b, i] < i for i < num_nodes[b] (default: all N), so node 0
    has parent -1; another -1 starts a second tree of a forest (GDN verify: it reads the committed
    state). Padding entries are ignored. This reads the tensors on the host (a device sync): call it
    outside CUDA-graph capture.
    """
    if parent.dim() != 2 or (num_nodes is not None and num_nodes.shape != parent.shape[:1]):
        raise ValueError(f"parent must be [B, N] and num_nodes [B], got {tuple(parent.shape)} "
                         f"and {None if num_nodes is None else tuple(num_nodes.shape)}")
    B, N = parent.shape
    p, n = parent.detach().cpu().long(), _num_nodes(parent, num_nodes).cpu()
    if bool(((n < 0) | (n > N)).any()):
        raise ValueError(f"num_nodes must lie in [0, {N}], got {n.tolist()}")
    idx = torch.arange(N)
    real = idx[None, :] < n[:, None]
    bad = real & ((p >= idx[None, :]) | (p < -1))
    if bool(bad.any()):
        b, i = (int(t) for t in bad.nonzero()[0])
        raise ValueError(f"parents must be topological (-1 <= parent[b, i] < i): "
                         f"parent[{b}, {i}] = {int(p[b, i])}; permute the nodes first")
    return not bool((real & (idx[None, :] >= 1) & (p < 0)).any())


def ancestor_mask(parent: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """Inclusive ancestor matrix by pointer doubling (ceil(log2 N) + 1 rounds of gathers).

    Args:
        parent: int [B, N] (or [N], treated as B = 1), topological, root's parent -1.
        num_nodes: int [B] or None (= all N nodes valid).
    Returns:
        anc: bool [B, N, N] (or [N, N] for 1-D input); `anc[b, i, j]` = j is i or an ancestor of i.
    """
    squeeze = parent.dim() == 1
    if squeeze:
        parent = parent[None]
    B, N = parent.shape
    dev = parent.device
    idx = torch.arange(N, device=dev)
    valid = idx[None, :] < _num_nodes(parent, num_nodes)[:, None]
    # The root (and padding) points at itself so that doubling stays inside the tree.
    up = torch.where(valid & (parent >= 0), parent.long(), idx[None, :].expand(B, N))
    anc = (idx[:, None] == idx[None, :]).expand(B, N, N).clone()
    for _ in range(max(1, (N - 1).bit_length()) + 1):
        # anc_{k+1}[i] = anc_k[i] | anc_k[up_k[i]]: ancestors within distance < 2^(k+1).
        anc = anc | torch.gather(anc, 1, up[:, :, None].expand(B, N, N))
        up = torch.gather(up, 1, up)
    anc = anc & valid[:, :, None] & valid[:, None, :]
    return anc[0] if squeeze else anc


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool `[..., N]` mask into int32 words `[..., ceil(N / 32)]`, bit j % 32 of word j // 32."""
    *lead, N = mask.shape
    W = (N + WORD_BITS - 1) // WORD_BITS
    pad = W * WORD_BITS - N
    m = torch.nn.functional.pad(mask.to(torch.int64), (0, pad)).view(*lead, W, WORD_BITS)
    weights = torch.ones(WORD_BITS, dtype=torch.int64, device=mask.device) << torch.arange(
        WORD_BITS, device=mask.device
    )
    words = (m * weights).sum(-1)
    # Reinterpret the low 32 bits as signed int32 (bit 31 set -> negative).
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: int32 `[..., W]` (or int64 words viewed as int32 pairs) -> bool `[..., n]`."""
    if bits.dtype == torch.int64:
        bits = bits.contiguous().view(torch.int32)
    shifts = torch.arange(WORD_BITS, device=bits.device, dtype=torch.int32)
    b = (bits[..., :, None].to(torch.int64) >> shifts.to(torch.int64)) & 1
    return b.flatten(-2)[..., :n].bool()


def ancestor_bitmask(parent: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """`pack_bits(ancestor_mask(parent, num_nodes))`: int32 [B, N, ceil(N / 32)]."""
    return pack_bits(ancestor_mask(parent, num_nodes))


def tree_depth(parent: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """Depth of every node (root 0; padding 0): int32 [B, N] (or [N] for 1-D input)."""
    anc = ancestor_mask(parent, num_nodes)
    return (anc.sum(-1) - 1).clamp(min=0).to(torch.int32)


def _num_nodes(parent: torch.Tensor, num_nodes: torch.Tensor | None) -> torch.Tensor:
    B, N = parent.shape
    if num_nodes is None:
        return torch.full((B,), N, dtype=torch.long, device=parent.device)
    return num_nodes.to(device=parent.device, dtype=torch.long).reshape(B)
