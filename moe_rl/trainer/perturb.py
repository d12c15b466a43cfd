"""The routing perturbations an RL step can inject (routing.drift, routing.logit_noise, routing.weight_noise):
which forward each one touches, with what scale and which draws. The mechanisms live in moe_rl.routing.

| perturbation | forwards | replay |
|---|---|---|
| drift (expert dropout) | update forwards of mini-batches >= routing.drift_from_minibatch | off only |
| logit noise, scope update | update forwards, σ_j = σ·sqrt(j - 1) (or σ) | off only: R2 and R3 immune |
| logit noise, scope trainer | old-policy and update forwards, one ε, σ | R2 replays the perturbed old routing (its update forward's free choice is recorded perturbed too); R3 immune |
| weight noise | the router weights themselves, after every optimizer step | none immune |

Each function takes what it reads (the routing config, the controller, the run seed), not the trainer's
StepContext: the step's context never leaves moe_rl/trainer/step.py. Shape legend as there.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from moe_rl.rollout.forward import position_ids_from_mask
from moe_rl.routing import LogitNoise, logit_noise, noise_scale
from moe_rl.trainer.precision import MasterAdamW

if TYPE_CHECKING:
    from moe_rl.config import RoutingConfig
    from moe_rl.routing import RoutingController
    from moe_rl.trainer.batch import Batch


def _generator(seed: int, step: int, minibatch: int) -> torch.Generator:
    """A CPU generator of its own for (seed, step, mini-batch): a perturbation never shifts another draw."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + minibatch)


def drifting(r: RoutingConfig, controller: RoutingController, seed: int, step: int, minibatch: int):
    """`controller.drift(p, generator)` for this update forward, or None: drift is on when p > 0, replay is
    off (replay wins) and the mini-batch (0-based) is at or after routing.drift_from_minibatch."""
    if r.drift == 0 or r.replay != "off" or minibatch + 1 < r.drift_from_minibatch:
        return None
    return controller.drift(r.drift, _generator(seed, step, minibatch))


def noising(r: RoutingConfig, controller: RoutingController, seed: int, step: int, batch: Batch, sl: slice,
            forward: str, minibatch: int = 0):
    """`controller.noise(...)` for mini-batch `sl`'s `forward` ("old" or "update"), or a null context when
    routing.logit_noise leaves that forward alone (see the table above)."""
    if r.noise_scope == "trainer":  # the trainer's routing itself is perturbed; R3 replays the sampler's
        on = r.replay != "rollout"
    else:  # only the updates; R2 and R3 replay clean routing, so nothing is drawn
        on = forward == "update" and r.replay == "off"
    scale = noise_scale(r.logit_noise, r.noise_growth, minibatch)
    if not (on and scale > 0):
        return contextlib.nullcontext()
    return controller.noise(step_noise(controller, seed, step, batch, sl, scale))


def step_noise(
    controller: RoutingController, seed: int, step: int, batch: Batch, sl: slice, scale: float
) -> LogitNoise:
    """The step's logit noise ε for the forward over rows `sl` (every position it sees), at `scale`."""
    mask_bS1 = batch.attention_mask_BS[sl][:, :-1]
    eps = logit_noise(
        seed,
        step,
        batch.rows_B[sl].cpu(),
        position_ids_from_mask(mask_bS1).cpu(),
        controller.num_layers,
        controller.num_experts,
    )
    return LogitNoise(eps, scale)


@torch.no_grad()
def perturb_router_weights(r: RoutingConfig, controller: RoutingController, optimizer: torch.optim.Optimizer,
                           seed: int, step: int, minibatch: int) -> None:
    """routing.weight_noise: add N(0, σ_w²) to every router weight after an optimizer step. Under
    trainer.master_weights the float32 master takes the noise and the model gets it rounded, as an update
    would; every rank draws the same noise from the same generator."""
    sigma = r.weight_noise
    if sigma == 0:
        return
    g = _generator(seed, step, minibatch)
    master = {}
    if isinstance(optimizer, MasterAdamW):
        master = {id(p): m for p, m in zip(optimizer.model_params, optimizer.master_params, strict=True)}
    for router in controller.routers:
        w = router.weight
        noise = (torch.randn(w.shape, generator=g, dtype=torch.float32) * sigma).to(w.device)
        if id(w) in master:
            master[id(w)].add_(noise)
            w.copy_(master[id(w)])
        else:
            w.add_(noise.to(w.dtype))
