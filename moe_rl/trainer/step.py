"""One RL step: sample, score, old-policy forward, then M mini-batch updates with optional routing replay.

Shape legend: B rollout rows (P prompts x G completions), b mini-batch rows, S sequence (prompt P +
response R), S1 = S - 1 positions a forward sees, L MoE layers, K top-k.

Where this departs from the GSPO paper: the old-policy log-probs are computed per mini-batch, on the
same rows the update will use, so that the first (on-policy) mini-batch reproduces them bitwise and
its ratios are exactly 1. Expert change is measured on each mini-batch's training forward before its
update: the routers' free top-k against the old policy's. Under replay the free choice at layer l is
taken given the replayed routing of layers < l (one forward, no extra cost); with replay off it is
exactly the paper's quantity.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moe_rl.config import Config
from moe_rl.objectives import OBJECTIVES, group_advantages
from moe_rl.rollout import Rollout, response_logprobs, sample
from moe_rl.routing import (
    RoutingController,
    RoutingTrace,
    expert_change_by_layer,
    expert_change_fraction,
    expert_load,
    router_entropy,
)
from moe_rl.tasks import Task
from moe_rl.trainer.collapse import CollapseDetector


@dataclass
class Batch:
    """A scored rollout in mini-batch order (rows permuted once, mini-batches are contiguous slices)."""

    input_ids_BS: torch.Tensor
    attention_mask_BS: torch.Tensor
    response_mask_BR: torch.Tensor
    valid_BS1: torch.Tensor  # positions a forward sees that hold real tokens (routing metrics)
    adv_B: torch.Tensor
    sampler_logp_BR: torch.Tensor
    sampler_trace: RoutingTrace | None

    @classmethod
    def from_rollout(cls, roll: Rollout, adv_B: torch.Tensor, perm_B: torch.Tensor) -> Batch:
        valid_BS = torch.cat([roll.prompt_mask_BP.bool(), roll.response_mask_BR], dim=1)
        trace = roll.routing.rows(perm_B) if roll.routing is not None else None
        return cls(
            roll.input_ids_BS[perm_B],
            roll.attention_mask_BS[perm_B],
            roll.response_mask_BR[perm_B],
            valid_BS[perm_B, :-1],
            adv_B[perm_B],
            roll.logp_BR[perm_B],
            trace,
        )


def _mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


@dataclass
class StepContext:
    """What a step needs besides the config: the policy, its routers, the optimiser and the RNGs."""

    cfg: Config
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    controller: RoutingController
    task: Task
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sample_gen: torch.Generator
    shuffle_gen: torch.Generator
    detector: CollapseDetector
    ref_model: PreTrainedModel | None = None
    sampler_model: PreTrainedModel | None = None
    """A separate sampler copy of the policy at another precision (trainer.sampler_dtype), else None."""
    sampler_controller: RoutingController | None = None

    def sync_sampler(self) -> None:
        """Copy the trained weights into the sampler copy (cast to its dtype), as an inference engine would."""
        if self.sampler_model is not None:
            self.sampler_model.load_state_dict(self.model.state_dict())


def _rollout(ctx: StepContext, step: int) -> tuple[Rollout, torch.Tensor, dict[str, float]]:
    cfg, t = ctx.cfg, ctx.cfg.trainer
    examples = ctx.task.examples("train", t.prompts_per_step, seed=cfg.seed * 1_000_003 + step)
    prompts = [ex.prompt for ex in examples for _ in range(t.group_size)]
    model, controller = ctx.model, ctx.controller
    if ctx.sampler_model is not None:
        model, controller = ctx.sampler_model, ctx.sampler_controller
    model.eval()
    roll = sample(model, ctx.tokenizer, prompts, cfg.sampler, generator=ctx.sample_gen, controller=controller)
    rewards = [
        ctx.task.reward(ex, text)
        for ex, text in zip([ex for ex in examples for _ in range(t.group_size)], roll.texts, strict=True)
    ]
    rewards_B = torch.tensor(rewards, dtype=torch.float32)
    mask = roll.response_mask_BR
    metrics = {
        "rollout/reward/mean": rewards_B.mean().item(),
        "rollout/reward/std": rewards_B.std().item(),
        "rollout/accuracy": (rewards_B == 1).float().mean().item(),
        "rollout/response_len/mean": mask.sum(1).float().mean().item(),
        "rollout/entropy/mean": (roll.entropy_BR[mask].mean().item()),
    }
    return roll, rewards_B, metrics


@torch.no_grad()
def _old_policy(
    ctx: StepContext, batch: Batch, slices: list[slice]
) -> tuple[list[torch.Tensor], list[RoutingTrace]]:
    """Old-policy log-probs and routing (with logits), one forward per mini-batch."""
    R = batch.response_mask_BR.shape[1]
    logps, traces = [], []
    for sl in slices:
        with ctx.controller.record(with_logits=True) as rec:
            logps.append(
                response_logprobs(
                    ctx.model,
                    batch.input_ids_BS[sl],
                    batch.attention_mask_BS[sl],
                    R,
                    ctx.cfg.sampler.temperature or 1.0,
                )
            )
        traces.append(rec.trace)
    return logps, traces


def _update(
    ctx: StepContext, step: int, batch: Batch, sl: slice, old_logp_bR: torch.Tensor, old_trace: RoutingTrace
) -> tuple[dict[str, float], torch.Tensor]:
    """One optimizer step on a mini-batch; returns its metrics and per-layer expert change."""
    cfg = ctx.cfg
    R = batch.response_mask_BR.shape[1]
    replay = {
        "off": None,
        "old": old_trace,
        "rollout": None if batch.sampler_trace is None else batch.sampler_trace.rows(sl),
    }[cfg.routing.replay]
    ctx.model.train()
    ids_bS, attn_bS = batch.input_ids_BS[sl], batch.attention_mask_BS[sl]
    temperature = cfg.sampler.temperature or 1.0
    replaying = ctx.controller.replay(replay) if replay is not None else contextlib.nullcontext()
    with ctx.controller.record() as rec, replaying:
        logp_bR = response_logprobs(ctx.model, ids_bS, attn_bS, R, temperature)
    change_L = expert_change_by_layer(rec.trace, old_trace, batch.valid_BS1[sl])
    ref_logp = None
    if ctx.ref_model is not None:
        with torch.no_grad():
            ref_logp = response_logprobs(ctx.ref_model, ids_bS, attn_bS, R, temperature)
    o = cfg.objective
    loss, metrics = OBJECTIVES[o.name](
        logp_bR,
        old_logp_bR,
        batch.adv_B[sl],
        batch.response_mask_BR[sl],
        clip_low=o.clip_low,
        clip_high=o.clip_high,
        loss_agg=o.loss_agg,
        max_len=cfg.sampler.max_new_tokens,
        beta=o.beta,
        ref_logp=ref_logp,
        extreme_band=tuple(o.extreme_band),
    )
    metrics["train/loss"] = loss.item()
    metrics["train/grad_norm"] = math.nan
    if not math.isfinite(metrics["train/loss"]):
        ctx.detector.nonfinite(step, metrics["train/loss"])
        return metrics, change_L
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), cfg.trainer.grad_clip).item()
    metrics["train/grad_norm"] = grad_norm
    if math.isfinite(grad_norm):
        ctx.optimizer.step()
    else:
        ctx.detector.nonfinite(step, grad_norm)
    ctx.optimizer.zero_grad(set_to_none=True)
    ctx.scheduler.step()
    return metrics, change_L


def rl_step(ctx: StepContext, step: int) -> dict[str, float]:
    """Run one RL step and return its metrics (see the metric table in moe_rl/trainer/__init__.py)."""
    cfg, t = ctx.cfg, ctx.cfg.trainer
    t0 = time.perf_counter()
    roll, rewards_B, metrics = _rollout(ctx, step)
    adv_B = group_advantages(rewards_B, t.group_size, normalize_std=cfg.objective.normalize_std)
    perm_B = torch.randperm(len(rewards_B), generator=ctx.shuffle_gen)
    batch = Batch.from_rollout(roll, adv_B.to(roll.logp_BR.device), perm_B.to(roll.logp_BR.device))
    b = len(perm_B) // t.mini_batches
    slices = [slice(j * b, (j + 1) * b) for j in range(t.mini_batches)]
    t1 = time.perf_counter()
    old_logps, old_traces = _old_policy(ctx, batch, slices)
    old_trace = RoutingTrace.cat(old_traces)
    t2 = time.perf_counter()

    per_mb, changes = [], []
    for j, sl in enumerate(slices):
        m, change_L = _update(ctx, step, batch, sl, old_logps[j], old_traces[j])
        per_mb.append(m)
        changes.append(change_L)
    ctx.sync_sampler()
    t3 = time.perf_counter()

    for key in per_mb[0]:
        metrics[key] = _mean([m[key] for m in per_mb])
    metrics["train/lr"] = ctx.scheduler.get_last_lr()[0]
    metrics.update(_routing_metrics(batch, old_trace, torch.cat(old_logps), changes, cfg.routing.replay))
    tokens = int(batch.valid_BS1.sum()) + len(perm_B)
    metrics.update(
        {
            "time/step_s": t3 - t0,
            "time/rollout_s": t1 - t0,
            "time/old_forward_s": t2 - t1,
            "time/train_s": t3 - t2,
            "throughput/tokens_per_s": tokens / (t3 - t0),
            "throughput/sampler_tokens_per_s": int(roll.response_mask_BR.sum()) / (t1 - t0),
        }
    )
    extremes = {
        "ratio/token/max": max(m["ratio/token/max"] for m in per_mb),
        "ratio/token/min": min(m["ratio/token/min"] for m in per_mb),
    }
    ctx.detector.observe(step, {**metrics, **extremes})
    metrics["collapse/events"] = float(len(ctx.detector.events))
    metrics["collapse/new_events"] = float(sum(1 for e in ctx.detector.events if e.step == step))
    return metrics


def _routing_metrics(
    batch: Batch, old_trace: RoutingTrace, old_logp_BR: torch.Tensor, changes: list[torch.Tensor], replay: str
) -> dict[str, float]:
    valid = batch.valid_BS1
    out = {
        "routing/expert_change/first_minibatch": float(changes[0].mean()),
        "routing/load_cv/mean": float(expert_load(old_trace, valid)["cv"].mean()),
        "routing/entropy/mean": float(router_entropy(old_trace, valid).mean()),
        # Bytes of expert ids a replay must hold for the step (logits are recorded for metrics only).
        "routing/replay_cache_bytes": float(0 if replay == "off" else old_trace.expert_ids_BTLK.nbytes),
        "mismatch/logp_abs_diff/mean": float(
            (batch.sampler_logp_BR - old_logp_BR)[batch.response_mask_BR].abs().mean()
        ),
    }
    if batch.sampler_trace is not None:
        out["routing/rollout_vs_old/frac"] = expert_change_fraction(batch.sampler_trace, old_trace, valid)
    if len(changes) > 1:
        later_L = torch.stack(changes[1:]).mean(0)
        out["routing/expert_change/frac"] = float(later_L.mean())
        out["routing/expert_change/after_one_update"] = float(changes[1].mean())
        out.update({f"routing/expert_change/layer_{i}": float(v) for i, v in enumerate(later_L)})
    return out
