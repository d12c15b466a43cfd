"""Bounded staleness (rollout.staleness = k): step t trains on rollouts that the policy of step t - k sampled.

Two samplers wrap any `Sampler` (samplers.py), so the hf policy, its dtype copy and vLLM all sample stale:

| wrapper | when step t + k is sampled | resume |
|---|---|---|
| `StaleSampler` (default) | at the start of step t, with its weights, before step t trains | bit-exact: the k waiting rollouts are in the checkpoint |
| `OverlapSampler` (rollout.overlap) | on a background thread, as soon as the trainer has finished step t, while it trains step t + 1 | the in-flight rollouts are re-sampled with the restored weights (the run warns) |

A rollout's `version` is the number of RL steps the weights that sampled it had trained; its staleness at
step t is t - version, k for t >= k under `StaleSampler` (the first k steps train on the initial policy's
rollouts, staleness t), anywhere in 0..k under `OverlapSampler`, which samples step s with the newest
weights once the trainer has pushed version s - k. Every row of a rollout shares its version.

What each arm's ratio then means (AReaL's decoupled PPO, arXiv 2505.24298): the behaviour policy is the stale
sampler (`Rollout.logp_BR`, the objective's `sampler_logp`), the proximal policy of the clip is the trainer
at the start of step t (the old-policy forward), and the rollout corrections (objective.rollout_is) weight
proximal / behaviour. R2 replays the proximal forward's routing; R3 replays the stale sampler's.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

import torch
from transformers import PreTrainedModel

from moe_rl.errors import RunError
from moe_rl.rollout import Rollout, SamplingSupport
from moe_rl.routing import RoutingController, RoutingTrace
from moe_rl.tasks import Task
from moe_rl.trainer.samplers import PolicySampler, Sampler, Scores, Shard

_TYPES = {cls.__name__: cls for cls in (Rollout, RoutingTrace, SamplingSupport, Scores)}


def encode(value: Any) -> Any:
    """A rollout, its scores (or any of their parts) as tensors, numbers, strings, lists and dicts only:
    what a checkpoint's `weights_only` loading accepts."""
    if dataclasses.is_dataclass(value):
        return {"__type": type(value).__name__,
                **{f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return value


def decode(value: Any, device: torch.device | str = "cpu") -> Any:
    """`encode`'s inverse, tensors moved to `device`."""
    if isinstance(value, dict) and "__type" in value:
        kind = _TYPES[value["__type"]]
        return kind(**{k: decode(v, device) for k, v in value.items() if k != "__type"})
    if isinstance(value, list):
        return [decode(v, device) for v in value]
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return value


@dataclasses.dataclass
class StaleSampler:
    """Deterministic staleness: at the start of step t the current weights sample step t + k (and, at a run's
    first step, every step up to it), which waits in `pending` (checkpointed) until step t + k trains on it."""

    inner: Sampler
    staleness: int
    pending: dict[int, tuple[Rollout, Scores]] = dataclasses.field(default_factory=dict)
    exact = False  # the weights that sampled a rollout are k steps older than those that train on it

    def rollout(self, task: Task, step: int, shard: Shard) -> tuple[Rollout, Scores]:
        # Always k ahead, even past trainer.steps (k rollouts no step trains on, at the end): a run resumed
        # with more steps then finds the rollouts an uninterrupted run would have sampled.
        for ahead in range(step, step + self.staleness + 1):
            if ahead not in self.pending:
                started = time.perf_counter()
                roll, scores = self.inner.rollout(task, ahead, shard)
                self.pending[ahead] = (dataclasses.replace(roll, version=step, sample_s=time.perf_counter() - started),
                                       scores)
        return self.pending.pop(step)

    def sync(self, model: PreTrainedModel) -> float | None:
        return self.inner.sync(model)

    def verify(self, model: PreTrainedModel, controller: RoutingController, probe: str, probe_ids: torch.Tensor) -> None:
        self.inner.verify(model, controller, probe, probe_ids)

    def state_dict(self) -> dict:
        """The waiting rollouts, keyed by the step that will train on them."""
        return {"pending": {str(s): encode(item) for s, item in self.pending.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.pending = {int(s): tuple(decode(item)) for s, item in state.get("pending", {}).items()}

    def close(self) -> None:
        self.inner.close()


class OverlapSampler:
    """Overlapped staleness: a background thread samples with its own copy of the policy (`inner`, a
    `CopySampler`), up to k steps ahead of the trainer, loading the trainer's newest weights before each
    rollout. `sync` pushes a snapshot of the trainer's weights (a version) and returns the seconds it took."""

    exact = False  # a rollout's weights are up to k steps older than those that train on it

    def __init__(self, inner: PolicySampler, staleness: int, steps: int, threads: int) -> None:
        self.inner, self.staleness, self.steps, self.threads = inner, staleness, steps, threads
        self._cond = threading.Condition()
        self._ready: dict[int, tuple[Rollout, Scores]] = {}
        self._weights: dict[str, torch.Tensor] | None = None
        self._trained = 0
        self._error: BaseException | None = None
        self._failed_at: int | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    def rollout(self, task: Task, step: int, shard: Shard) -> tuple[Rollout, Scores]:
        if self._thread is None:
            self._start(task, step, shard)
        with self._cond:
            self._cond.wait_for(lambda: step in self._ready or self._error is not None)
            if step in self._ready:  # sampled before the failure, which a later step meets
                return self._ready.pop(step)
            raise RunError(
                f"the background sampler (rollout.overlap=true) failed at step {self._failed_at}: {self._error}"
            ) from self._error

    def _start(self, task: Task, first: int, shard: Shard) -> None:
        with self._cond:
            self._trained = first  # the weights pushed so far (a restored run's) are version `first`
        self._thread = threading.Thread(target=self._work, args=(task, first, shard), name="moe-rl-sampler", daemon=True)
        self._thread.start()

    def _work(self, task: Task, first: int, shard: Shard) -> None:
        torch.set_num_threads(self.threads)  # this thread's own intra-op pool (OpenMP's per-thread setting)
        s = first
        try:
            for s in range(first, self.steps):
                with self._cond:
                    self._cond.wait_for(lambda s=s: self._stop or self._trained >= s - self.staleness)
                    if self._stop:
                        return
                    weights, version, self._weights = self._weights, self._trained, None
                if weights is not None:
                    self.inner.model.load_state_dict(weights)
                started = time.perf_counter()
                roll, scores = self.inner.rollout(task, s, shard)
                with self._cond:
                    self._ready[s] = (dataclasses.replace(roll, version=version, sample_s=time.perf_counter() - started),
                                      scores)
                    self._cond.notify_all()
        except BaseException as err:  # handed to the trainer's next rollout, which raises it
            with self._cond:
                self._error, self._failed_at = err, s
                self._cond.notify_all()

    def sync(self, model: PreTrainedModel) -> float:
        started = time.perf_counter()
        snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with self._cond:
            self._weights, self._trained = snapshot, self._trained + 1
            self._cond.notify_all()
        return time.perf_counter() - started

    def verify(self, model: PreTrainedModel, controller: RoutingController, probe: str, probe_ids: torch.Tensor) -> None:
        self.inner.verify(model, controller, probe, probe_ids)

    def state_dict(self) -> dict:
        return {}  # in-flight rollouts are not kept: a resume samples them again

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()


def thread_split(trainer_threads: int, sampler_threads: int) -> tuple[int, int]:
    """(trainer, sampler) torch threads under rollout.overlap: 0 for the sampler is half the cores (at
    least 1), 0 for the trainer is the rest (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    sampler = sampler_threads or max(1, cores // 2)
    return trainer_threads or max(1, cores - sampler), sampler
