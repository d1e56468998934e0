"""SwiGLU of a fused gate-up projection, y = silu(x[:, :F]) * x[:, F:], one pass each way (Triton).

The backward reads gate, up and dy once and writes the gradient straight into x's [N, 2F] layout, so nothing is
concatenated. torch.compile's fused pointwise backward computes each half of that gradient on its own and so
reads gate and up twice. Registered as the custom op `tfm::swiglu`: torch.compile keeps it whole, without a graph
break.
"""
import torch
import triton
import triton.language as tl

from tfm_kernels.launch import strided_rows


@triton.jit
def _gate_up_tile(x, N, F, BN: tl.constexpr, BF: tl.constexpr):
    """The [BN, BF] tile of this program: (gate, up) fp32, its row and column offsets and its in-range mask."""
    o_n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    o_f = tl.program_id(1) * BF + tl.arange(0, BF)
    m = (o_n < N)[:, None] & (o_f < F)[None, :]
    p_x = x + o_n[:, None] * (2 * F) + o_f[None, :]
    g = tl.load(p_x, mask=m, other=0.).to(tl.float32)
    u = tl.load(p_x + F, mask=m, other=0.).to(tl.float32)
    return g, u, o_n, o_f, m


@triton.jit
def swiglu_fwd_kernel(x, y, N, F, BN: tl.constexpr, BF: tl.constexpr):
    """y[n, f] = silu(x[n, f]) * x[n, F + f] for a [BN, BF] tile; grid (cdiv(N, BN), cdiv(F, BF)).
    x [N, 2F], y [N, F], both row-major; math in fp32, one rounding to y's dtype."""
    g, u, o_n, o_f, m = _gate_up_tile(x, N, F, BN, BF)
    tl.store(y + o_n[:, None] * F + o_f[None, :], (g * tl.sigmoid(g) * u).to(y.dtype.element_ty), mask=m)


@triton.jit
def swiglu_bwd_kernel(x, dy, dx, N, F, BN: tl.constexpr, BF: tl.constexpr):
    """dx[n, f] = dy * up * silu'(gate), dx[n, F + f] = dy * silu(gate) for a [BN, BF] tile (gate = x[n, f],
    up = x[n, F + f], dy = dy[n, f], silu'(g) = s (1 + g (1 - s)), s = sigmoid(g)). x, dx [N, 2F], dy [N, F]."""
    g, u, o_n, o_f, m = _gate_up_tile(x, N, F, BN, BF)
    d = tl.load(dy + o_n[:, None] * F + o_f[None, :], mask=m, other=0.).to(tl.float32)
    s = tl.sigmoid(g)
    p_dx = dx + o_n[:, None] * (2 * F) + o_f[None, :]
    tl.store(p_dx, (d * u * s * (1 + g * (1 - s))).to(dx.dtype.element_ty), mask=m)
    tl.store(p_dx + F, (d * g * s).to(dx.dtype.element_ty), mask=m)


@triton.jit
def silu_mul_kernel(g, u, y, N, F, s_g, s_u, BN: tl.constexpr, BF: tl.constexpr):
    """y = silu(g) * u for a [BN, BF] tile of [N, F] tensors (rows of g and u s_g and s_u apart, y row-major), with
    torch's roundings of `F.silu(g) * u`: silu in fp32 rounded to y's dtype, then the product in fp32 rounded
    again."""
    o_n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    o_f = tl.program_id(1) * BF + tl.arange(0, BF)
    m = (o_n < N)[:, None] & (o_f < F)[None, :]
    p = o_n[:, None] * F + o_f[None, :]
    a = tl.load(g + o_n[:, None] * s_g + o_f[None, :], mask=m, other=0.).to(tl.float32)
    b = tl.load(u + o_n[:, None] * s_u + o_f[None, :], mask=m, other=0.).to(tl.float32)
    s = (a / (1.0 + tl.exp(-a))).to(y.dtype.element_ty).to(tl.float32)
    tl.store(y + p, (s * b).to(y.dtype.element_ty), mask=m)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of two separate projections in one launch (forward only; inference): gate, up [..., F] of
    one dtype (fp16 / bf16 / fp32) and shape on one device -> [..., F] contiguous, rounded as `F.silu(gate) * up`
    (two launches) rounds. Rows at one stride with a contiguous last dim (e.g. the two halves of a fused gate/up
    projection's output) are read in place."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device or gate.dim() == 0:
        raise ValueError(f"silu_mul expects gate and up of one shape, dtype and device, got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
    if gate.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"silu_mul expects fp16, bf16 or fp32, got {gate.dtype}")
    F = gate.shape[-1]
    g2, u2 = strided_rows(gate), strided_rows(up)
    y = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if g2.numel():
        BN, BF = 4, min(1024, triton.next_power_of_2(F))
        silu_mul_kernel[(triton.cdiv(g2.shape[0], BN), triton.cdiv(F, BF))](
            g2, u2, y, g2.shape[0], F, g2.stride(0), u2.stride(0), BN=BN, BF=BF, num_warps=8)
    return y.view(gate.shape)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, tuple[int, int], dict]:
    """x [..., 2F] -> (x as contiguous [N, 2F], N, F, the launch grid, the tile constants)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    N, F = x2.shape[0], x2.shape[1] // 2
    BN, BF = 4, min(1024, triton.next_power_of_2(F))
    return x2, N, F, (triton.cdiv(N, BN), triton.cdiv(F, BF)), dict(BN=BN, BF=BF, num_warps=8)


@torch.library.custom_op("tfm::swiglu", mutates_args=())
def _swiglu(x: torch.Tensor) -> torch.Tensor:
    x2, N, F, grid, meta = _rows(x)
    y = torch.empty(N, F, dtype=x.dtype, device=x.device)
    swiglu_fwd_kernel[grid](x2, y, N, F, **meta)
    return y.view(*x.shape[:-1], F)


@_swiglu.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.custom_op("tfm::swiglu_backward", mutates_args=())
def _swiglu_backward(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    x2, N, F, grid, meta = _rows(x)
    dx = torch.empty_like(x2)
    swiglu_bwd_kernel[grid](x2, dy.reshape(N, F).contiguous(), dx, N, F, **meta)
    return dx.view(x.shape)


@_swiglu_backward.register_fake
def _(x, dy):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dy):
    return _swiglu_backward(ctx.saved_tensors[0], dy)


_swiglu.register_autograd(_backward, setup_context=_setup_context)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate, up] along the last dim (differentiable in x).

    Args:
        x: [..., 2F] fp16 / bf16 / fp32 on a Triton device (the output of a fused gate-up projection).
    Returns:
        y: [..., F] of x's dtype (math in fp32, rounded once).
    """
    if x.dim() < 1 or x.shape[-1] % 2 or x.shape[-1] == 0:
        raise ValueError(f"swiglu expects x [..., 2F] with an even, non-zero last dim, got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"swiglu expects fp16, bf16 or fp32, got {x.dtype}")
    return _swiglu(x)
