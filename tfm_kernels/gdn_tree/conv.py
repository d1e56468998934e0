"""Depthwise causal short conv (GDN's width-4 conv on mixed qkv) along tree ancestor paths.

Node i convolves the last W inputs of the sequence  [committed conv state (oldest first),
path root..i].  A walk position `src` >= 0 is a node; src < 0 is entry S + src of the committed
state (-1 = newest), so stepping back from the root just keeps decrementing.

x may be a strided view (e.g. the mixed qkv columns of a fused in-projection's output): the kernels address node i
of request b at b * s_xb + i * s_xn, channels contiguous.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def tree_conv1d_kernel(x, s_xb, s_xn, conv_state, weight, bias, parent, num_nodes, state_idx, out,
                       N: tl.constexpr, D: tl.constexpr, S: tl.constexpr, W: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BN: tl.constexpr,
                       BD: tl.constexpr):
    i_d, i_n, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    conv_tile(x, s_xb, s_xn, conv_state, weight, bias, parent, num_nodes, state_idx, out, i_d, i_n, i_b,
              N, D, S, W, HAS_BIAS, SILU, BN, BD)


@triton.jit
def conv_tile(x, s_xb, s_xn, conv_state, weight, bias, parent, num_nodes, state_idx, out, i_d, i_n, i_b,
              N: tl.constexpr, D: tl.constexpr, S: tl.constexpr, W: tl.constexpr,
              HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """Output tile [BN nodes, BD channels] (i_n, i_d) of request i_b (int64); node i of request b's input at
    x + b * s_xb + i * s_xn (channels contiguous), out [B, N, D] contiguous."""
    i_s = tl.load(state_idx + i_b).to(tl.int64)
    n = tl.where(i_s >= 0, tl.load(num_nodes + i_b), 0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_d = i_d * BD + tl.arange(0, BD)
    m_n, m_d = o_n < n, o_d < D
    b_y = tl.zeros([BN, BD], dtype=tl.float32)
    if HAS_BIAS:
        b_y += tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)[None, :]
    b_src = o_n
    for m in tl.static_range(W):
        # tap W-1-m multiplies the input m steps back along the path
        b_w = tl.load(weight + o_d * W + (W - 1 - m), mask=m_d, other=0.).to(tl.float32)
        m_node = m_n & (b_src >= 0)
        m_old = m_n & (b_src < 0) & (S + b_src >= 0)
        b_x = tl.load(x + i_b * s_xb + b_src[:, None].to(tl.int64) * s_xn + o_d[None, :],
                      mask=m_node[:, None] & m_d[None, :], other=0.).to(tl.float32)
        b_x += tl.load(conv_state + (i_s * D + o_d[None, :]) * S + (S + b_src)[:, None],
                       mask=m_old[:, None] & m_d[None, :], other=0.).to(tl.float32)
        b_y += b_x * b_w[None, :]
        if m < W - 1:
            b_par = tl.load(parent + i_b * N + b_src, mask=m_node, other=-1)
            b_src = tl.where(b_src >= 0, tl.maximum(b_par, -1), b_src - 1)
    if SILU:
        b_y = b_y * tl.sigmoid(b_y)
    b_y = tl.where(m_n[:, None], b_y, 0.)
    tl.store(out + (i_b * N + o_n[:, None]) * D + o_d[None, :], b_y.to(out.dtype.element_ty),
             mask=(o_n < N)[:, None] & m_d[None, :])


@triton.jit
def tree_conv1d_commit_kernel(x, s_xb, s_xn, conv_state, parent, leaf, state_idx, out_idx,
                              N: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
                              BS: tl.constexpr, BD: tl.constexpr):
    i_d, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_s = tl.load(state_idx + i_b).to(tl.int64)
    i_o = tl.load(out_idx + i_b).to(tl.int64)
    if (i_s >= 0) & (i_o >= 0):
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < D
        # state slot s (oldest first) takes the input S-1-s steps back from the leaf
        o_s = tl.arange(0, BS)
        b_back = S - 1 - o_s
        b_src = tl.zeros([BS], dtype=tl.int64) + tl.load(leaf + i_b).to(tl.int64)
        for m in tl.static_range(S - 1):
            m_step = b_back > m
            b_par = tl.load(parent + i_b * N + b_src, mask=m_step & (b_src >= 0), other=-1)
            b_src = tl.where(m_step, tl.where(b_src >= 0, tl.maximum(b_par, -1), b_src - 1), b_src)
        m_s = o_s < S
        m_node = (m_s & (b_src >= 0))[:, None] & m_d[None, :]
        m_old = (m_s & (b_src < 0))[:, None] & m_d[None, :]
        # [BS, BD]
        b_x = tl.load(x + i_b * s_xb + b_src[:, None] * s_xn + o_d[None, :], mask=m_node, other=0.)
        b_c = tl.load(conv_state + (i_s * D + o_d[None, :]) * S + (S + b_src)[:, None],
                      mask=m_old, other=0.)
        b_new = tl.where(m_node, b_x.to(conv_state.dtype.element_ty), b_c)
        tl.store(conv_state + (i_o * D + o_d[None, :]) * S + o_s[:, None], b_new,
                 mask=m_s[:, None] & m_d[None, :])


def tree_conv1d(x, conv_state, weight, bias, parent, num_nodes, state_idx, activation="silu",
                block_n=16, block_d=128):
    r"""Short causal depthwise conv over a tree: each node sees its ancestors, then the cache.

    Args:
        x: [B, N, D] conv input of every node (e.g. mixed qkv before the conv); a strided view whose last dim is
            contiguous is read in place.
        conv_state: [P, D, S] committed inputs per pool slot, oldest first, S >= W - 1. Read only.
        weight: [D, W] (a `Conv1d(D, D, W, groups=D)` weight squeezed).  bias: [D] or None.
        parent: [B, N] int, -1 <= parent[b, i] < i.  num_nodes: [B] int.
        state_idx: [B] int32 conv-state slot per request; -1 = padded request (zero output).
        activation: "silu" or None.
    Returns:
        out: [B, N, D] in x.dtype, contiguous (zero for padding nodes).
    """
    B, N, D = x.shape
    x = node_rows(x)
    W, S = weight.shape[1], conv_state.shape[2]
    if weight.shape[0] != D or conv_state.shape[1] != D or S < W - 1:
        raise ValueError(f"expected weight [{D}, W] and conv_state [P, {D}, S >= W-1], got "
                         f"{tuple(weight.shape)} and {tuple(conv_state.shape)}")
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    out = torch.empty(B, N, D, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(D, block_d), triton.cdiv(N, block_n), B)
    tree_conv1d_kernel[grid](
        x, x.stride(0), x.stride(1), conv_state, weight.contiguous(), bias, parent.contiguous(),
        num_nodes.contiguous(), state_idx.contiguous(), out, N=N, D=D, S=S, W=W,
        HAS_BIAS=bias is not None, SILU=activation == "silu", BN=block_n, BD=block_d)
    return out


def tree_conv1d_commit(x, conv_state, leaf, parent, state_idx, out_idx=None, block_d=256):
    r"""Write the conv state after accepting root..leaf: the last S inputs of that sequence.

    Args:
        x: [B, N, D] the conv inputs given to `tree_conv1d` (a strided view with a contiguous last dim is read in
            place).
        conv_state: [P, D, S] pool; slot state_idx[b] is read, slot out_idx[b] written.
        leaf: [B] int accepted leaf; -1 = nothing accepted (the old state is copied).
        parent: [B, N] int.  state_idx: [B] int32 (-1 = padded request, nothing written).
        out_idx: [B] int32. Default: `state_idx` (in place).
    Returns:
        conv_state (written in place).
    """
    B, N, D = x.shape
    x = node_rows(x)
    S = conv_state.shape[2]
    out_idx = state_idx if out_idx is None else out_idx
    grid = (triton.cdiv(D, block_d), B)
    tree_conv1d_commit_kernel[grid](
        x, x.stride(0), x.stride(1), conv_state, parent.contiguous(), leaf.contiguous(),
        state_idx.contiguous(), out_idx.contiguous(), N=N, D=D, S=S,
        BS=max(2, triton.next_power_of_2(S)), BD=block_d)
    return conv_state


def node_rows(t: torch.Tensor) -> torch.Tensor:
    """t [B, N, D] as the kernels read it: itself where its last dim is contiguous (rows at strides t.stride(0),
    t.stride(1), e.g. column slices of a wider tensor), else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()
