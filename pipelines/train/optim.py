"""The optimizer the trainer hands DeepSpeed: fused AdamW that skips non-finite steps and clips its gradients
without waiting on the GPU.

Skipping: before each update the optimizer checks the step's loss (set by the loop in `loss`) and the gradient
norm; when either is not finite, the fused AdamW kernel leaves the weights and the optimizer state untouched
(`found_inf`, the mechanism torch's GradScaler uses), all on the device: the loop reads `skipped` a step later.
Every rank reaches the same decision (the check is all-reduced).

Clipping: DeepSpeed's ZeRO 1/2 clipping reads the gradient norm back to the host (a scalar built on the host and a
validity check, two syncs per step), so the host cannot queue the next step while the GPU finishes this one.
Under ZeRO stages 1 and 2 the trainer turns DeepSpeed's clipping and norm off and `ClippedAdamW` clips instead,
with the same rule (scale the gradients by min(1, max_norm / (norm + 1e-6))), entirely on the device. DeepSpeed
hands it its rank's partition of the flat fp32 gradients, so the squared norms are summed across ranks. Under
ZeRO 0 DeepSpeed clips (a non-finite norm there makes every gradient NaN, which this optimizer then sees).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class ClippedAdamW(torch.optim.AdamW):
    """Fused AdamW that first checks the step's loss and gradient norm and skips the update when either is not
    finite, then clips the global 2-norm of its gradients to `max_norm` (0: no clipping). The norm before clipping
    stays on the device in `grad_norm`, the skip flag (1.0: skipped) in `skipped`; the loop reads both a step late.
    `partitioned`: each rank holds a disjoint part of the gradients (ZeRO 1/2), so the squared norm is summed across
    ranks; otherwise every rank holds them all."""

    def __init__(self, params, *, max_norm: float, partitioned: bool, **kwargs):
        super().__init__(params, **{**kwargs, "fused": True})
        # DeepSpeed steps one parameter group at a time; a global norm needs them all in one step
        if len(self.param_groups) != 1:
            raise ValueError(f"ClippedAdamW takes one parameter group, got {len(self.param_groups)}")
        self.max_norm, self.partitioned = max_norm, partitioned
        self.loss: torch.Tensor | None = None          # this rank's loss of the step being taken (set by the loop)
        self.grad_norm: torch.Tensor | None = None
        self.skipped: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return super().step(closure)
        sq = torch.stack([n.float() for n in torch._foreach_norm(grads)]).square().sum()
        bad = torch.zeros((), device=sq.device) if self.loss is None else \
            (~torch.isfinite(self.loss.to(sq.device))).float()
        check = torch.stack([sq, bad])                                          # [squared norm, bad loss]
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(check)
            if not self.partitioned:                                            # every rank summed the same norm
                check[0] /= world
        self.grad_norm = check[0].sqrt()
        self.skipped = ((check[1] > 0) | ~torch.isfinite(self.grad_norm)).float()
        if self.max_norm > 0:
            torch._foreach_mul_(grads, (self.max_norm / (self.grad_norm + 1e-6)).clamp(max=1.0))
        self.found_inf = self.skipped                   # read by the fused kernel: skip the whole update
        return super().step(closure)


def owns_clipping(zero_stage: int) -> bool:
    """Whether `make_optimizer`'s optimizer clips (ZeRO stages 1 and 2, where DeepSpeed hands the optimizer each
    rank's partition of the flat fp32 gradients and can skip its own norm) rather than DeepSpeed (stage 0)."""
    return zero_stage in (1, 2)


def make_optimizer(params, *, lr: float, weight_decay: float, grad_clip: float, zero_stage: int,
                   device: torch.device) -> ClippedAdamW:
    """Fused AdamW (betas 0.9/0.95; one kernel over DeepSpeed's flat fp32 partition) that skips non-finite steps,
    clipping itself where `owns_clipping` (TrainConfig.deepspeed_config then turns DeepSpeed's clipping off)."""
    own = owns_clipping(zero_stage)
    return ClippedAdamW(params, max_norm=grad_clip if own else 0.0, partitioned=own, lr=lr, betas=(0.9, 0.95),
                        weight_decay=weight_decay)
