"""float64 reference for the small masked attention: plain torch, obviously correct."""
import torch


def small_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
    """softmax(scale * q k^T, masked) v, computed in float64.

    Args:
        q: [B, nh, T, hd]; k, v: [B, nh, S, hd] (any float dtype, any strides).
        mask: bool, broadcastable to [B, nh, T, S] (True = the key is visible).
        scale: Default: hd ** -0.5.
    Returns:
        o: float64 [B, nh, T, hd]. A row with no visible key is 0 (softmax over nothing).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.double() @ k.double().transpose(-1, -2)) * scale                       # [B, nh, T, S]
    s = s.masked_fill(~mask, float("-inf"))
    # Softmax written out so that an all-masked row gives p = 0 (and zero gradients), not NaN.
    m = s.amax(-1, keepdim=True)                                                  # [B, nh, T, 1]
    e = torch.exp(s - torch.where(m == float("-inf"), 0.0, m))                    # masked keys: exp(-inf) = 0
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, 1.0)                                        # [B, nh, T, S]
    return p @ v.double()                                                         # [B, nh, T, hd]
