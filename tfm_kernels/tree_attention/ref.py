"""float64 reference for tree attention: slow, loop-based, obviously correct."""
import math

import torch

from tfm_kernels.tree_utils import unpack_bits


def tree_attention_ref(
    q: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    prefix_len: torch.Tensor,
    anc: torch.Tensor,
    num_nodes: torch.Tensor,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every tree node over the whole prefix plus its ancestors (itself included).

    Args:
        q: [B, N, Hq, D]; k_tree, v_tree: [B, N, Hkv, D]; k_prefix, v_prefix: [B, Lmax, Hkv, D];
        prefix_len: int [B] (<= Lmax); anc: bool [B, N, N] or int32 bitmask [B, N, ceil(N/32)];
        num_nodes: int [B]. Hq must be a multiple of Hkv (q head h reads kv head h // (Hq // Hkv)).
    Returns:
        o: float64 [B, N, Hq, D] (0 on padding nodes); lse: float64 [B, N, Hq] (natural log,
        -inf on padding nodes).
    """
    B, N, Hq, D = q.shape
    Hkv = k_tree.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if sm_scale is None else sm_scale
    if anc.dtype != torch.bool:
        anc = unpack_bits(anc, N)
    o = torch.zeros(B, N, Hq, D, dtype=torch.float64, device=q.device)
    lse = torch.full((B, N, Hq), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(B):
        L, n = int(prefix_len[b]), int(num_nodes[b])
        if n == 0:
            continue
        # Visible keys: all L prefix columns, then the ancestor-or-self tree columns.
        vis = torch.cat([torch.ones(n, L, dtype=torch.bool, device=q.device), anc[b, :n, :n].bool()], 1)
        for h in range(Hq):
            kv = h // G
            K = torch.cat([k_prefix[b, :L, kv], k_tree[b, :n, kv]]).double()  # [L+n, D]
            V = torch.cat([v_prefix[b, :L, kv], v_tree[b, :n, kv]]).double()
            s = (q[b, :n, h].double() @ K.T) * scale  # [n, L+n]
            s = s.masked_fill(~vis, -math.inf)
            lse[b, :n, h] = torch.logsumexp(s, -1)
            o[b, :n, h] = torch.softmax(s, -1) @ V
    return o, lse


def tree_attention_sdpa(q, k_tree, v_tree, k_prefix, v_prefix, prefix_len, anc, num_nodes, sm_scale=None):
    """Same function through `F.scaled_dot_product_attention` with a boolean mask, for B = 1.

    The cross-check the spec asks for (and the baseline of the benchmark): the prefix and the tree
    keys are concatenated and the KV heads repeated G times. Returns o [1, n, Hq, D] in q.dtype.
    """
    assert q.shape[0] == 1, "the SDPA form is written for one request"
    Hq, Hkv = q.shape[2], k_tree.shape[2]
    L, n = int(prefix_len[0]), int(num_nodes[0])
    if anc.dtype != torch.bool:
        anc = unpack_bits(anc, q.shape[1])
    k = torch.cat([k_prefix[0, :L], k_tree[0, :n]]).transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
    v = torch.cat([v_prefix[0, :L], v_tree[0, :n]]).transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
    vis = torch.cat([torch.ones(n, L, dtype=torch.bool, device=q.device), anc[0, :n, :n]], 1)
    o = torch.nn.functional.scaled_dot_product_attention(
        q[0, :n].transpose(0, 1)[None], k[None], v[None], attn_mask=vis, scale=sm_scale
    )
    return o[0].transpose(0, 1)[None]
