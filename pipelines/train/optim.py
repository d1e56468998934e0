"""The optimizer the trainer hands DeepSpeed: AdamW, with gradient clipping that never waits on the GPU.

DeepSpeed's ZeRO 1/2 clipping reads the gradient norm back to the host (a scalar built on the host and a
validity check, two syncs per step), so the host cannot queue the next step while the GPU finishes this one.
Under ZeRO stages 1 and 2 the trainer turns DeepSpeed's clipping and norm off and `ClippedAdamW` clips instead, with
the same rule (scale the gradients by min(1, max_norm / (norm + 1e-6))), entirely on the device. DeepSpeed hands
it its rank's partition of the flat fp32 gradients, so the squared norms are summed across ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that first clips the global 2-norm of its gradients to `max_norm` (0: no clipping); the norm before
    clipping stays on the device in `grad_norm` (the loop reads it a step late). `partitioned`: each rank holds
    a disjoint part of the gradients (ZeRO), so the squared norm is all-reduced."""

    def __init__(self, params, *, max_norm: float, partitioned: bool, **kwargs):
        super().__init__(params, **kwargs)
        # DeepSpeed steps one parameter group at a time; a global norm needs them all in one step
        if len(self.param_groups) != 1:
            raise ValueError(f"ClippedAdamW takes one parameter group, got {len(self.param_groups)}")
        self.max_norm, self.partitioned = max_norm, partitioned
        self.grad_norm: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            sq = torch.stack([n.float() for n in torch._foreach_norm(grads)]).square().sum()
            if self.partitioned and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(sq)
            self.grad_norm = sq.sqrt()
            if self.max_norm > 0:
                torch._foreach_mul_(grads, (self.max_norm / (self.grad_norm + 1e-6)).clamp(max=1.0))
        return super().step(closure)


def owns_clipping(zero_stage: int) -> bool:
    """Whether `make_optimizer`'s optimizer clips (ZeRO stages 1 and 2, where DeepSpeed hands the optimizer each
    rank's partition of the flat fp32 gradients and can skip its own norm) rather than DeepSpeed (stages 0, 3)."""
    return zero_stage in (1, 2)


def make_optimizer(params, *, lr: float, weight_decay: float, grad_clip: float, zero_stage: int,
                   device: torch.device) -> torch.optim.Optimizer:
    """AdamW (betas 0.9/0.95, fused on GPU: one kernel over DeepSpeed's flat fp32 partition), clipping itself
    where `owns_clipping` (TrainConfig.deepspeed_config then turns DeepSpeed's clipping off)."""
    kw = dict(lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=device.type == "cuda")
    if owns_clipping(zero_stage):
        return ClippedAdamW(params, max_norm=grad_clip, partitioned=True, **kw)
    return torch.optim.AdamW(params, **kw)
