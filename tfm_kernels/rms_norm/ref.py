"""float64 reference of RMSNorm with an optional bias."""
import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 eps: float = 1e-6, one_plus: bool = False, gate: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D], weight [D], bias [D] or None -> x / sqrt(mean(x^2) + eps) * weight (+ bias) [..., D], float64;
    one_plus: * (1 + weight); gate [..., D]: then * silu(gate)."""
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight.double() + (1.0 if one_plus else 0.0))
    y = y + bias.double() if bias is not None else y
    return y * torch.nn.functional.silu(gate.double()) if gate is not None else y
