"""A GDN layer's verify inputs in one launch: the tree short conv of mixed qkv and the gates g, beta.

    conv   out[b, i] = silu(bias + sum_m w[:, W-1-m] x[m steps up the path root..i, then the conv state])
    gates  g[b, i, h] = -exp(A_log[h]) softplus(a[b, i, h] + dt_bias[h]),   beta[b, i, h] = sigmoid(b[b, i, h])

The grid is the tree conv's (channel tiles x node tiles x requests) plus one column of programs that each compute
the gates of a node tile, so the gates cost no launch of their own (in torch they are several). x, a and b may be
strided views with a contiguous last dim (the column slices of one fused in-projection's output), read in place.
"""
import torch
import triton
import triton.language as tl

from .conv import conv_tile, node_rows


@triton.jit
def tree_gdn_inputs_kernel(x, s_xb, s_xn, conv_state, weight, bias, parent, num_nodes, state_idx, out,
                           a, s_ab, s_an, b, s_bb, s_bn, A_log, dt_bias, g, beta, N: tl.constexpr,
                           D: tl.constexpr, S: tl.constexpr, W: tl.constexpr, HV: tl.constexpr,
                           ND: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                           BH: tl.constexpr):
    """Node i of request b: x at b * s_xb + i * s_xn, a at b * s_ab + i * s_an, b at b * s_bb + i * s_bn (last
    dims contiguous); out, g, beta contiguous."""
    i_d, i_n, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    if i_d < ND:
        conv_tile(x, s_xb, s_xn, conv_state, weight, bias, parent, num_nodes, state_idx, out, i_d, i_n,
                  i_b, N, D, S, W, HAS_BIAS, True, BN, BD)
    else:
        o_n = i_n * BN + tl.arange(0, BN)
        o_h = tl.arange(0, BH)
        m_h = o_h < HV
        m = (o_n < N)[:, None] & m_h[None, :]
        p = (i_b * N + o_n[:, None]) * HV + o_h[None, :]
        # [BN, BH]
        b_a = tl.load(a + i_b * s_ab + o_n[:, None].to(tl.int64) * s_an + o_h[None, :], mask=m,
                      other=0.).to(tl.float32)
        b_b = tl.load(b + i_b * s_bb + o_n[:, None].to(tl.int64) * s_bn + o_h[None, :], mask=m,
                      other=0.).to(tl.float32)
        b_A = tl.load(A_log + o_h, mask=m_h, other=0.).to(tl.float32)
        b_dt = tl.load(dt_bias + o_h, mask=m_h, other=0.).to(tl.float32)
        b_x = b_a + b_dt[None, :]
        # softplus as torch computes it (threshold 20)
        b_sp = tl.where(b_x > 20., b_x, tl.log(1. + tl.exp(tl.minimum(b_x, 20.))))
        tl.store(g + p, -tl.exp(b_A)[None, :] * b_sp, mask=m)
        tl.store(beta + p, tl.sigmoid(b_b), mask=m)


def tree_gdn_inputs(x, conv_state, weight, bias, parent, num_nodes, state_idx, a, b, A_log, dt_bias,
                    block_n=16, block_d=128):
    r"""Tree short conv (SiLU) of a GDN layer's mixed qkv and its gates, in one launch.

    Args:
        x: [B, N, D] conv inputs (mixed qkv before the conv).
        conv_state: [P, D, S] committed inputs per pool slot, oldest first, S >= W - 1. Read only.
        weight: [D, W].  bias: [D] or None.
        parent: [B, N] int, -1 <= parent[b, i] < i.  num_nodes: [B] int.
        state_idx: [B] int32 conv-state slot per request; -1 = padded request (zero conv output).
        a, b: [B, N, HV] raw gate projections.  A_log, dt_bias: [HV].
        x, a, b may be strided views whose last dim is contiguous (read in place; else copied first).
    Returns:
        out [B, N, D] in x.dtype (as `tree_conv1d(..., activation="silu")`), g and beta [B, N, HV] fp32, all
        contiguous.
    """
    B, N, D = x.shape
    W, S, HV = weight.shape[1], conv_state.shape[2], a.shape[2]
    if weight.shape[0] != D or conv_state.shape[1] != D or S < W - 1:
        raise ValueError(f"expected weight [{D}, W] and conv_state [P, {D}, S >= W-1], got "
                         f"{tuple(weight.shape)} and {tuple(conv_state.shape)}")
    if a.shape != (B, N, HV) or b.shape != (B, N, HV) or A_log.shape != (HV,) or dt_bias.shape != (HV,):
        raise ValueError(f"expected a, b [{B}, {N}, HV] and A_log, dt_bias [HV], got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}, {tuple(A_log.shape)}, {tuple(dt_bias.shape)}")
    x, a, b = node_rows(x), node_rows(a), node_rows(b)
    out = torch.empty(B, N, D, dtype=x.dtype, device=x.device)
    g = torch.empty(B, N, HV, dtype=torch.float32, device=x.device)
    beta = torch.empty(B, N, HV, dtype=torch.float32, device=x.device)
    ND = triton.cdiv(D, block_d)
    tree_gdn_inputs_kernel[(ND + 1, triton.cdiv(N, block_n), B)](
        x, x.stride(0), x.stride(1), conv_state, weight.contiguous(), bias, parent.contiguous(),
        num_nodes.contiguous(), state_idx.contiguous(), out, a, a.stride(0), a.stride(1), b, b.stride(0),
        b.stride(1), A_log.contiguous(), dt_bias.contiguous(), g, beta, N=N, D=D, S=S, W=W, HV=HV, ND=ND,
        HAS_BIAS=bias is not None, BN=block_n, BD=block_d, BH=triton.next_power_of_2(HV))
    return out, g, beta
