"""Per-step tree metadata shared by every GDN layer: ancestor bitmasks (and the shared parent check)."""
import torch

from tfm_kernels.tree_utils import ancestor_bitmask, check_parents

MAX_NODES = 256


def tree_ancestor_bits(parent, num_nodes, check=True):
    """Inclusive ancestor bitmask, built once per step and shared by all layers.

    Bit j % 32 of word anc[b, i, j // 32] is set iff node j lies on the path root..i
    (padding rows are all zero). A thin wrapper of `tfm_kernels.tree_utils.ancestor_bitmask` (the one
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
