"""float64 reference of the SwiGLU of a fused gate-up projection."""
import torch


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2F] (gate = x[..., :F], up = x[..., F:]) -> silu(gate) * up [..., F], float64."""
    gate, up = x.double().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
