"""float64 reference of RMSNorm with an optional bias."""
import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
    """x [..., D], weight [D], bias [D] or None -> x / sqrt(mean(x^2) + eps) * weight (+ bias) [..., D], float64."""
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return y + bias.double() if bias is not None else y
