"""float64 references of the rotary embeddings: q and k of a fused qkv projection (the Weaver), and q and k of a
target's attention layer by position (the K/V cache writes are copies)."""
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


def rope_cache_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   pos: torch.Tensor, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 1e-6, one_plus: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, nq, D], k [T, nk, D]; cos, sin tables [P, R] (R <= D even: partial rotary) read at pos [T] ->
    q, k float64 with their first R dims rotated (half-split convention over those R) and the rest as they were;
    with q_norm / k_norm [D], each head first RMS-normalised over D and scaled by the weight (one_plus: 1 + it)."""
    R = cos.shape[-1]
    c, s = cos.double()[pos][:, None], sin.double()[pos][:, None]           # [T, 1, R]

    def norm(x, w):
        if w is None:
            return x.double()
        x, w = x.double(), w.double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w if one_plus else w)
    q, k = norm(q, q_norm), norm(k, k_norm)

    def rot(x):
        x = x.double()
        x1, x2 = x[..., :R].chunk(2, dim=-1)
        return torch.cat([x[..., :R] * c + torch.cat([-x2, x1], dim=-1) * s, x[..., R:]], dim=-1)
    return rot(q), rot(k)
