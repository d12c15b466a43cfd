"""`RoutingPlan`: which routing each forward of an RL step uses. The one owner of the replay source
(routing.replay, whose row of `moe_rl.routing.config.REPLAY` it reads), the logit noise (its scope and
growth), drift, the router-weight noise and the experts RSPO's router shift compares against; no other module
branches on them.

| perturbation | forwards | replay |
|---|---|---|
| replay `old` (R2) | update forwards replay the old-policy forward's routing | |
| replay `rollout` (R3, arXiv 2510.11370) | old-policy *and* update forwards replay the sampler's routing | |
| drift (expert dropout) | update forwards of mini-batches >= routing.drift_from_minibatch | off only |
| logit noise, scope update | update forwards, σ_j = σ·sqrt(j - 1) (or σ) | off only: R2 and R3 immune |
| logit noise, scope trainer | old-policy and update forwards, one ε, σ | R2 replays the perturbed old routing (its update forward's free choice is recorded perturbed too); R3 immune |
| weight noise | the router weights themselves, after every optimizer step | none immune |

A replay source whose trace is missing raises; nothing falls back to free routing. Each perturbation
draws from a CPU generator of its own for (seed, step, mini-batch), so it never shifts another draw.
Shape legend as in moe_rl/trainer/step.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moe_rl.rollout.forward import position_ids_from_mask
from moe_rl.routing import Drift, LogitNoise, RoutingReplayError, RoutingTrace, logit_noise, noise_scale
from moe_rl.routing.config import FREE, OLD_POLICY, REPLAY, SAMPLER, Replay
from moe_rl.trainer.precision import master_copies

if TYPE_CHECKING:
    from moe_rl.routing import RoutingController
    from moe_rl.routing.config import RoutingConfig
    from moe_rl.trainer.batch import Batch


@dataclass
class UpdateRouting:
    """What an update forward ran under: its drift context and its replay (each None when off)."""

    drift: Drift | None = None
    replay: Any = None
    """The controller's replayer (`replaced_BTL` under partial replay)."""


def perturbs(r: RoutingConfig) -> bool:
    """Whether the config replays or injects any routing perturbation (moe-rl-calibrate applies its own)."""
    return bool(r.drift or r.logit_noise or r.weight_noise or REPLAY[r.replay].replays)


def noise_sigma(routing: RoutingConfig, j: int) -> float:
    """The logit-noise scale that re-routes update forward j beyond the old forward: σ_j under scope
    update with replay off, else 0 (scope trainer gives both forwards one ε; replay is immune). A setting
    of the run: it reads the config alone."""
    noisy = routing.noise_scope == "update" and not REPLAY[routing.replay].immune("update_noise")
    return noise_scale(routing.logit_noise, routing.noise_growth, j) if noisy else 0.0


def drift_minibatches(routing: RoutingConfig, M: int) -> range | None:
    """The mini-batches over which `routing/drift/applied_frac` is pooled, or None when drift is off (it is
    measured where drift is configured, even where replay wins)."""
    return range(routing.drift_from_minibatch - 1, M) if routing.drift > 0 else None


@dataclass
class RoutingPlan:
    """The routing of one RL step's forwards over `batch` (module docstring): `old(sl)` and `update(j, sl,
    old_trace)` are the contexts its forwards run in, `noise_sigma(j)` what re-routes update j beyond the
    old forward, `after_update` the router-weight noise."""

    routing: RoutingConfig
    controller: RoutingController
    batch: Batch
    step: int
    seed: int

    @property
    def source(self) -> Replay:
        """The replay source's row: which routing each forward uses and what it is immune to."""
        return REPLAY[self.routing.replay]

    @property
    def replays(self) -> bool:
        """Whether the update forwards replay recorded routing (R2 or R3)."""
        return self.source.replays

    @property
    def records_gates(self) -> bool:
        """Whether the old-policy forward records its gates with its expert ids (routing.replay_gates), for
        a replay of them."""
        return self.routing.replay_gates

    def replay_cache_bytes(self, old_trace: RoutingTrace) -> float:
        """Bytes of expert ids a replay holds for the step (0 when replay is off)."""
        return float(old_trace.expert_ids_BTLK.nbytes if self.replays else 0)

    def sampler_trace(self, sl: slice) -> RoutingTrace:
        """The sampler's routing of a mini-batch, for R3; raises rather than fall back to free routing."""
        if self.batch.sampler_trace is None:
            raise RoutingReplayError("routing.replay=rollout needs the sampler's routing trace, but none was recorded")
        return self.batch.sampler_trace.rows(sl)

    def activated(self, sl: slice, old_trace: RoutingTrace) -> RoutingTrace:
        """The experts the old policy activated on mini-batch `sl` (RSPO's router shift): its own top-k, or
        under R3 the sampler's that it replayed."""
        return self.sampler_trace(sl) if self.source.old_forward == SAMPLER else old_trace

    @contextlib.contextmanager
    def old(self, sl: slice) -> Iterator[None]:
        """The old-policy forward of mini-batch `sl`: R3 replays the sampler's routing; scope-trainer noise
        perturbs it (the same ε as every update forward of these rows)."""
        with contextlib.ExitStack() as stack:
            if self.source.old_forward == SAMPLER:
                stack.enter_context(self.controller.replay(self.sampler_trace(sl), self.routing.replay_gates,
                                                           self.routing.replay_score_ratio))
            stack.enter_context(self._noising(sl, "old"))
            yield

    @contextlib.contextmanager
    def update(self, j: int, sl: slice, old_trace: RoutingTrace) -> Iterator[UpdateRouting]:
        """The update forward of mini-batch j (0-based) over rows `sl`: replay (R2: `old_trace`, R3: the
        sampler's), drift and logit noise as the table says; yields what it ran under (`UpdateRouting`)."""
        with contextlib.ExitStack() as stack:
            trace = {FREE: lambda: None, OLD_POLICY: lambda: old_trace, SAMPLER: lambda: self.sampler_trace(sl)}[
                self.source.update_forward
            ]()
            used = UpdateRouting()
            if trace is not None:
                used.replay = stack.enter_context(self.controller.replay(trace, self.routing.replay_gates,
                                                                         self.routing.replay_score_ratio))
            if self.drifts(j):
                used.drift = stack.enter_context(self.controller.drift(self.routing.drift,
                                                                       _generator(self.seed, self.step, j)))
            stack.enter_context(self._noising(sl, "update", j))
            yield used

    def partial(self) -> bool:
        """Whether the replay is partial (routing.replay_score_ratio > 0): the step logs its replace rate."""
        return self.replays and self.routing.replay_score_ratio > 0

    def drifts(self, j: int) -> bool:
        """Whether update forward j drifts: p > 0, replay off (replay wins), j + 1 >= drift_from_minibatch."""
        r = self.routing
        return r.drift > 0 and not self.source.immune("drift") and j + 1 >= r.drift_from_minibatch

    def measures_drift(self) -> bool:
        """Whether the step logs `routing/drift/applied_frac` (drift configured, even where replay wins)."""
        return self.routing.drift > 0

    def _noise_on(self, forward: str) -> bool:
        # Scope update: R2 and R3 replay clean routing. Scope trainer: the trainer's routing itself, both
        # forwards; only R3, which replays the sampler's, is immune.
        scope = self.routing.noise_scope
        if self.source.immune(f"{scope}_noise"):
            return False
        return scope == "trainer" or forward == "update"

    def _noising(self, sl: slice, forward: str, j: int = 0):
        scale = noise_scale(self.routing.logit_noise, self.routing.noise_growth, j)
        if not (self._noise_on(forward) and scale > 0):
            return contextlib.nullcontext()
        return self.controller.noise(step_noise(self.controller, self.seed, self.step, self.batch, sl, scale))

    @torch.no_grad()
    def after_update(self, optimizer: torch.optim.Optimizer, j: int) -> None:
        """routing.weight_noise: add N(0, σ_w²) to every router weight after optimizer step j. Under
        trainer.master_weights the float32 master takes the noise and the model gets it rounded, as an
        update would; every rank draws the same noise from the same generator."""
        sigma = self.routing.weight_noise
        if sigma == 0:
            return
        g = _generator(self.seed, self.step, j)
        master = master_copies(optimizer)
        for router in self.controller.routers:
            w = router.weight
            noise = (torch.randn(w.shape, generator=g, dtype=torch.float32) * sigma).to(w.device)
            if id(w) in master:
                master[id(w)].add_(noise)
                w.copy_(master[id(w)])
            else:
                w.add_(noise.to(w.dtype))


def _generator(seed: int, step: int, minibatch: int) -> torch.Generator:
    """A CPU generator of its own for (seed, step, mini-batch): a perturbation never shifts another draw."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + minibatch)


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
