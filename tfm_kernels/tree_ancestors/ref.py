"""Inclusive ancestor masks of padded parent rows in torch ops: the reference of the kernel in `triton.py`."""
import torch


def ancestors_ref(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [B, n] long (-1 at roots and padding; a node's parent comes before it) -> [B, n, n] bool: row i is
    True at i and at each ancestor of i, for trees at most `max_depth` deep. Each row follows its parent chain
    `max_depth` steps."""
    B, n = parents.shape
    cols = torch.arange(n, device=parents.device)
    cur = cols.expand(B, n)                                                      # [B, n] each row's node
    out = cur[..., None] == cols                                                 # [B, n, n] itself
    for _ in range(max_depth):
        cur = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), -1)     # [B, n] one level up
        out |= cur[..., None] == cols
    return out
