"""float64 reference of rotary embeddings on the q and k of a fused qkv projection."""
import torch


def rope_qk_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [B, T, 3, nh, hd]; cos, sin [B, T, hd] or [T, hd] (the half-split "rotate_half" convention) ->
    q, k [B, nh, T, hd] float64, rotated: x * cos + cat(-x2, x1) * sin with x = (x1, x2) split in halves."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.double()[:, None], sin.double()[:, None]                  # [B, 1, T, hd]
    q, k = qkv.double()[:, :, 0].transpose(1, 2), qkv.double()[:, :, 1].transpose(1, 2)   # [B, nh, T, hd]

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin
    return rot(q), rot(k)
