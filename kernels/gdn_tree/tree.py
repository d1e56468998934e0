"""Per-step tree metadata shared by every GDN layer: parent checks and ancestor bitmasks."""
import torch

from kernels.tree_utils import ancestor_bitmask

MAX_NODES = 256


def check_parents(parent, num_nodes) -> bool:
    """Raise ValueError unless every real node's parent comes before it; return whether node 0 is an
    ancestor of every real node of every request (only node 0 has parent -1: `single_root`).

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
    return not bool((real & (idx[None, :] >= 1) & (p < 0)).any())


def tree_ancestor_bits(parent, num_nodes, check=True):
    """Inclusive ancestor bitmask, built once per step and shared by all layers.

    Bit j % 32 of word anc[b, i, j // 32] is set iff node j lies on the path root..i
    (padding rows are all zero). A thin wrapper of `kernels.tree_utils.ancestor_bitmask` (the one
    implementation, shared with tree attention) that adds the host-side parent check.

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
    N = parent.shape[1]
    if N > MAX_NODES:
        raise ValueError(f"at most {MAX_NODES} nodes per tree are supported, got N={N}")
    if check:
        check_parents(parent, num_nodes)
    return ancestor_bitmask(parent, num_nodes)


def ancestor_bits_to_mask(anc, N=None):
    """Expand [B, N, NW] int32 bits to a dense [B, N, N] bool mask (for tests and debugging)."""
    N = anc.shape[1] if N is None else N
    j = torch.arange(N, device=anc.device)
    words = anc[:, :, j // 32]
    return ((words >> (j % 32)) & 1).bool()
