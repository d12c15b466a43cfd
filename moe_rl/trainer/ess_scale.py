"""VCPO's step scale (arXiv 2602.17616; mit-han-lab/vcpo `ess_scaling`): each optimizer step's lr times a
function of the effective sample size of the mini-batch's importance weights, restored right after.

    w_i    = exp(clamp(Σ_t (log π_old(y_it) − log μ(y_it)), ±LOG_RATIO_BOUND))    one weight per sequence
    ESS    = (Σ_i w_i)² / Σ_i w_i²,        n = the mini-batch's non-empty sequences (all ranks)
    factor = min(1, ESS / n)^(1/2)   (trainer.ess_step_scale=sqrt, VCPO's default rule)
           = min(1, ESS / n)         (linear)

The weights are the sequence product π_old/μ, as VCPO's (with its base_ess_ratio at 1 and its unclipped
weights); π_old is this step's old-policy forward, μ the sampler (so with a sampler that is the trained
model, w = 1 and the factor is 1). Every param group's lr is multiplied (the routers' own, under
trainer.router_lr_scale, too) for that one `optimizer.step()` and set back before the scheduler steps, so
the schedule never sees it. Shape legend: b mini-batch rows, R response positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from moe_rl.objectives.common import sequence_weights
from moe_rl.trainer.distributed import Dist


@torch.no_grad()
def ess_factor(old_logp_bR: torch.Tensor, sampler_logp_bR: torch.Tensor, mask_bR: torch.Tensor, rule: str,
               dist: Dist) -> float:
    """The lr factor of one mini-batch (module docstring), over every rank's rows (a collective)."""
    m = mask_bR.bool()
    w_b = sequence_weights(torch.where(m, old_logp_bR.double() - sampler_logp_bR.double(), 0.0), m)
    n, s1, s2 = dist.sum([float(w_b.numel()), float(w_b.sum()), float(w_b.square().sum())])
    ratio = min(1.0, s1 * s1 / (n * s2)) if n and s2 else 1.0
    return ratio**0.5 if rule == "sqrt" else ratio


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Every param group's lr times `factor` inside the block, exactly the old value after it."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
