"""float64 reference of the small fused linear layer."""
import torch
import torch.nn.functional as F

from tfm_kernels.rms_norm.ref import rms_norm_ref
from tfm_kernels.rope.ref import rope_qk_ref


def small_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     index: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                     norm_bias: torch.Tensor | None = None, eps: float = 1e-6, swiglu: bool = False,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (or a table [V, K] read at index [...]) -> [..., N] float64, in this order:
    h = rms_norm(x) (with norm_weight [K], norm_bias [K]); y = h @ weight.T + bias (weight [N_w, K], bias [N_w]);
    swiglu: y = silu(y[..., :N]) * y[..., N:] with N = N_w / 2 (else N = N_w); residual [..., N]: residual + y."""
    h = x.double() if index is None else x.double()[index]
    if norm_weight is not None:
        h = rms_norm_ref(h, norm_weight, norm_bias, eps)
    y = h @ weight.double().T
    y = y + bias.double() if bias is not None else y
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y + residual.double() if residual is not None else y


def small_qkv_rope_ref(x: torch.Tensor, weight: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None,
                       norm_bias: torch.Tensor | None = None,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, K], weight [3 * nh * hd, K] -> q, k, v [B, nh, T, hd] float64: qkv = rms_norm(x) @ weight.T as
    [B, T, 3, nh, hd], q and k rotated by cos, sin (tables [P, hd] read at positions [B, T], or [T, hd])."""
    B, T, _ = x.shape
    qkv = small_linear_ref(x, weight, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps)
    qkv = qkv.view(B, T, 3, num_heads, -1)
    if positions is not None:
        cos, sin = cos[positions], sin[positions]                                            # [B, T, hd]
    q, k = rope_qk_ref(qkv, cos, sin)
    return q, k, qkv[:, :, 2].transpose(1, 2)
