"""One RL step: sample, score, old-policy forward, then M mini-batch updates with optional routing replay.

Shape legend: B rollout rows (P prompts x G completions; this rank's share under data parallelism), b
mini-batch rows, S sequence (prompt P + response R), S1 = S - 1 positions a forward sees, L MoE layers,
K top-k, M mini-batches, C runs of M consecutive rows.

Data parallel (moe_rl.trainer.distributed): rank r samples its contiguous share of the P x G rows, so a
group's completions stay on one rank; the mini-batches are drawn for the global batch identically on
every rank; metrics are gathered and reduced identically on every rank before anyone logs them, so the
collapse detector decides the same everywhere. With the same seed and global batch, W processes train
as one does, up to float reduction order.

Where this departs from the GSPO paper: the old-policy log-probs are computed per mini-batch, on the
same rows the update will use, so that the first (on-policy) mini-batch reproduces them bitwise and
its ratios are exactly 1. Expert change is measured on each mini-batch's training forward before its
update: the routers' free top-k against the old policy's. Under replay the free choice at layer l is
taken given the replayed routing of layers < l (one forward, no extra cost); with replay off it is
exactly the paper's quantity.

Replay sources (routing.replay): `off` routes freely everywhere; `old` (R2) replays the old-policy
forward's routing in the update forwards; `rollout` (R3, arXiv 2510.11370, as NeMo RL does) replays the
sampler's routing in the old-policy forward *and* the update forwards, so that π_old, π_θ and the
sampler all see the same experts. A replay source whose trace is missing raises; nothing falls back.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moe_rl import stats as S
from moe_rl.config import Config
from moe_rl.objectives import OBJECTIVES, ObjectiveInputs, group_advantages
from moe_rl.objectives.common import LENGTH_SUMS, length_bins, length_metrics, length_sums
from moe_rl.objectives.router_shift import router_shift_ratio
from moe_rl.rollout import Rollout, response_logprobs, response_logprobs_and_aux, sample
from moe_rl.rollout.vllm_engine import VllmEngine
from moe_rl.routing import (
    Drift,
    RoutingController,
    RoutingReplayError,
    RoutingTrace,
    centred_shift_sq,
    expert_change_by_layer,
    expert_change_fraction,
)
from moe_rl.tasks import Task
from moe_rl.trainer.batch import Batch
from moe_rl.trainer.collapse import CollapseDetector
from moe_rl.trainer.distributed import Dist, minibatch_rows, reduce_metrics
from moe_rl.trainer.perturb import drifting, noising, perturb_router_weights
from moe_rl.trainer.step_metrics import (
    change_metrics,
    finite_mean,
    margin_metrics,
    minibatch_overlap,
    over_minibatches,
    ratio_extremes,
    response_margins,
    rollout_metrics,
    routing_metrics,
)


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
    dist: Dist = field(default_factory=Dist)
    """This process's rank and the job's size; a single process by default."""
    train_model: nn.Module | None = None
    """What the update forward calls: the DDP wrapper (its backward averages gradients over ranks), else
    the model itself (None). Sampling and old-policy forwards call `model`, which is never a wrapper."""
    sharded: bool = False
    """The policy is FSDP2-sharded: its every forward is a collective, so ranks sample in lock-step."""
    engine: VllmEngine | None = None
    """The vLLM engine that samples rollouts (sampler.engine=vllm), else None."""

    def __post_init__(self) -> None:
        if self.train_model is None:
            self.train_model = self.model

    def prompt(self, text: str) -> str:
        """A task prompt as the model sees it: plain, or one user turn of the chat template (task.chat_template)."""
        return chat_prompt(self.tokenizer, text) if self.cfg.task.chat_template else text

    def sync_sampler(self) -> float | None:
        """Copy the trained weights into the sampler (the vLLM engine, or the copy at trainer.sampler_dtype,
        cast to its dtype); the seconds it took, or None when the sampler is the trained model itself."""
        if self.engine is not None:
            return self.engine.sync(self.model)
        if self.sampler_model is None:
            return None
        started = time.perf_counter()
        self.sampler_model.load_state_dict(self.model.state_dict())
        return time.perf_counter() - started


def chat_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    """`text` as one user turn of the tokenizer's chat template, ending where the assistant's answer starts.

    A BOS the template writes is dropped when the tokenizer adds its own, so it is not doubled.
    """
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    bos = tokenizer.bos_token
    if bos and chat.startswith(bos) and tokenizer("").input_ids[:1] == [tokenizer.bos_token_id]:
        chat = chat[len(bos) :]
    return chat


def _rollout(ctx: StepContext, step: int) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
    """Sample and score this rank's rows of the step's P x G completions: the rollout, `rewards_B` and
    `failed_B` (1 where the task's reward failed and scored 0: a dataset's reward function)."""
    cfg, t, d = ctx.cfg, ctx.cfg.trainer, ctx.dist
    examples = ctx.task.examples("train", t.prompts_per_step, seed=cfg.seed * 1_000_003 + step)
    examples_B = [ex for ex in examples for _ in range(t.group_size)]
    prompts = [ctx.prompt(ex.prompt) for ex in examples]
    share = len(examples_B) // d.world
    rows = slice(d.rank * share, (d.rank + 1) * share)
    grouped = [prompt for prompt in prompts for _ in range(t.group_size)]
    if ctx.engine is not None:
        roll = ctx.engine.sample(grouped, seed=cfg.seed * 1_000_003 + step, rows=rows)
    else:
        model, controller = ctx.model, ctx.controller
        if ctx.sampler_model is not None:
            model, controller = ctx.sampler_model, ctx.sampler_controller
        model.eval()
        # Re-seeded from (seed, step) every step: ranks stop decoding when their own rows end, so the number
        # of draws so far differs between ranks, and must not decide later steps' noise.
        ctx.sample_gen.manual_seed(cfg.seed * 1_000_003 + step)
        roll = sample(
            model,
            ctx.tokenizer,
            grouped,
            cfg.sampler,
            generator=ctx.sample_gen,
            controller=controller,
            rows=rows,
            all_done=d.all_done if ctx.sharded else None,
            record_logits=t.reuse_sampler_logp,  # the sampler's trace is then the old policy's
        )
    rewards, failed = ctx.task.rewards(examples_B[rows], roll.texts)
    return roll, torch.tensor(rewards, dtype=torch.float32), torch.tensor(failed, dtype=torch.float64)


def _sampler_trace(batch: Batch, sl: slice) -> RoutingTrace:
    """The sampler's routing of a mini-batch, for R3; raises rather than fall back to free routing."""
    if batch.sampler_trace is None:
        raise RoutingReplayError("routing.replay=rollout needs the sampler's routing trace, but none was recorded")
    return batch.sampler_trace.rows(sl)


def _replaying(ctx: StepContext, trace: RoutingTrace | None):
    """`replay(trace)`, or no replay for `routing.replay=off` only (trace None)."""
    return ctx.controller.replay(trace) if trace is not None else contextlib.nullcontext()


@torch.no_grad()
def _old_policy(
    ctx: StepContext, batch: Batch, slices: list[slice], step: int = 0
) -> tuple[list[torch.Tensor], list[RoutingTrace]]:
    """Old-policy log-probs and routing (with logits), one forward per mini-batch. Under R3 the forward
    replays the sampler's routing; the trace it returns is then the routers' free choice given the
    replayed layers above (what expert change is measured against). Under routing.noise_scope=trainer
    it is perturbed by the step's logit noise (moe_rl.trainer.perturb)."""
    R = batch.response_mask_BR.shape[1]
    logps, traces = [], []
    for sl in slices:
        replay = _sampler_trace(batch, sl) if ctx.cfg.routing.replay == "rollout" else None
        with (
            ctx.controller.record(with_logits=True) as rec,
            _replaying(ctx, replay),
            noising(ctx.cfg.routing, ctx.controller, ctx.cfg.seed, step, batch, sl, "old"),
        ):
            logps.append(
                response_logprobs(
                    ctx.model,
                    batch.input_ids_BS[sl],
                    batch.attention_mask_BS[sl],
                    R,
                    ctx.cfg.sampler.temperature or 1.0,
                    batch.support_of(sl),
                )
            )
        traces.append(rec.trace)
    return logps, traces


def _loss_scales(ctx: StepContext, batch: Batch, slices: list[slice]) -> list[float]:
    """Per mini-batch, the factor on this rank's loss that makes the average over ranks (DDP's gradient
    average) the global mini-batch loss. Every rank holds as many rows of each mini-batch, so it is 1 when
    the loss is a mean over sequences; token-mean divides by the token count, which differs, so there it
    is W x this rank's tokens / all ranks' tokens."""
    if ctx.cfg.objective.loss_agg != "token-mean":
        return [1.0] * len(slices)
    tokens = [float(batch.response_mask_BR[sl].sum()) for sl in slices]
    totals = ctx.dist.sum(tokens)
    return [ctx.dist.world * n / max(total, 1.0) for n, total in zip(tokens, totals, strict=True)]


def _routing_change(
    ctx: StepContext,
    batch: Batch,
    sl: slice,
    used: RoutingTrace,
    old_trace: RoutingTrace,
    drift: Drift | None,
) -> dict[str, list[float]]:
    """A mini-batch's routing change (see `_update`): `used` is the routing its update forward used absent
    replay, `drift` the drift context it ran under (None when it did not drift)."""
    valid_bS1 = batch.valid_BS1[sl]
    change = {
        "layers": expert_change_by_layer(used, old_trace, valid_bS1).tolist(),
        "response": [expert_change_fraction(used, old_trace, _response_positions(batch, sl))],
    }
    if batch.sampler_trace is not None:
        change["rollout"] = [expert_change_fraction(batch.sampler_trace.rows(sl), used, valid_bS1)]
    if ctx.cfg.routing.drift > 0:
        slots = float(valid_bS1.sum()) * ctx.controller.num_layers
        swapped = 0.0 if drift is None else float(drift.applied_BTL[valid_bS1.cpu()].sum())
        change["drift"] = [swapped, slots]
    if used.router_logits_BTLE is not None:  # the live logits' shift since the old policy, response positions
        at = _response_positions(batch, sl).to(used.router_logits_BTLE.device)
        new, old = used.router_logits_BTLE[at], old_trace.router_logits_BTLE[at].to(used.router_logits_BTLE)
        change["shift"] = [centred_shift_sq(new, old), float(new.numel())]
    return change


def _objective(
    ctx: StepContext,
    batch: Batch,
    sl: slice,
    logp_bR: torch.Tensor,
    old_logp_bR: torch.Tensor,
    ref_logp_bR: torch.Tensor | None,
    router_shift_bR: torch.Tensor | None = None,
) -> tuple[torch.Tensor, S.Stats]:
    """The configured objective's (loss, stats) on mini-batch `sl`: the one registry lookup."""
    o = ctx.cfg.objective
    inputs = ObjectiveInputs(
        logp_bR,
        old_logp_bR,
        batch.adv_B[sl],
        batch.response_mask_BR[sl],
        clip_low=o.clip_low,
        clip_high=o.clip_high,
        loss_agg=o.loss_agg,
        max_len=ctx.cfg.sampler.max_new_tokens,
        beta=o.beta,
        ref_logp=ref_logp_bR,
        extreme_band=tuple(o.extreme_band),
        kl_estimator=o.kl_estimator,
        clip_ratio_c=o.clip_ratio_c,
        sampler_logp=batch.sampler_logp_BR[sl],
        rollout_is=o.rollout_is,
        rollout_is_cap=o.rollout_is_cap,
        extreme_weight_band=tuple(o.extreme_weight_band),
        rollout_is_band=tuple(o.rollout_is_band),
        mismatch_diagnostics=ctx.cfg.trainer.sampler_dtype is not None or ctx.engine is not None,
        tau_pos=o.tau_pos,
        tau_neg=o.tau_neg,
        opsm_delta=o.opsm_delta,
        router_shift=router_shift_bR,
    )
    return OBJECTIVES[o.name].compute(inputs)


def _router_shift(
    ctx: StepContext, batch: Batch, sl: slice, used: RoutingTrace, old_trace: RoutingTrace
) -> tuple[torch.Tensor, S.Stats]:
    """RSPO's γ̃ [b, R] of mini-batch `sl` from the routing traces, not a second forward: `used` holds this
    update forward's live router logits, `old_trace` the old policy's. The old policy's *activated* experts
    are its own top-k, or under R3 the sampler's it replayed."""
    R = batch.response_mask_BR.shape[1]
    activated = _sampler_trace(batch, sl) if ctx.cfg.routing.replay == "rollout" else old_trace
    return router_shift_ratio(
        used.router_logits_BTLE[:, -R:],  # the R positions that predict response tokens
        old_trace.router_logits_BTLE[:, -R:],
        activated.expert_ids_BTLK[:, -R:],
        batch.response_mask_BR[sl],
        ctx.cfg.objective.router_shift_floor,
    )


def _optimizer_step(ctx: StepContext, step: int, loss: torch.Tensor, minibatch: int = 0) -> float:
    """Backward, clip and step; returns the gradient norm (nan when the loss was not finite). A non-finite
    loss or gradient norm skips the update and is noted with the collapse detector. After a step,
    routing.weight_noise perturbs the router weights."""
    # Every rank must skip or take the update alike (a backward is a collective): decide on the sum.
    loss_sum = ctx.dist.sum([loss.item()])[0]
    if not math.isfinite(loss_sum):
        ctx.detector.nonfinite(step, loss_sum / ctx.dist.world, "train/loss")
        return math.nan
    ctx.dist.collective(loss.backward)  # DDP and FSDP reduce gradients across ranks in backward
    clip = ctx.cfg.trainer.grad_clip
    norm = torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), math.inf if clip is None else clip)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
    if math.isfinite(grad_norm):
        ctx.optimizer.step()
        perturb_router_weights(ctx.cfg.routing, ctx.controller, ctx.optimizer, ctx.cfg.seed, step, minibatch)
    else:
        ctx.detector.nonfinite(step, grad_norm, "train/grad_norm")
    ctx.optimizer.zero_grad(set_to_none=True)
    ctx.scheduler.step()
    return grad_norm


def _update(
    ctx: StepContext,
    step: int,
    batch: Batch,
    sl: slice,
    old_logp_bR: torch.Tensor,
    old_trace: RoutingTrace,
    loss_scale: float = 1.0,
    minibatch: int = 0,
) -> tuple[S.Finished, dict[str, list[float]]]:
    """One optimizer step on mini-batch `minibatch` (0-based); returns its metrics (floats, which keep
    their moe_rl.stats for the exact reduction over ranks) and its routing change:
    `layers`, the expert change per layer over valid positions; `response`, over response positions
    (`_response_positions`); `rollout`, the sampler's routing vs this forward's; `drift`, [swapped slots,
    valid slots] when routing.drift > 0. Expert change compares the routing this forward used absent
    replay (free, or drifted) with the old policy's. On the off-policy mini-batches (minibatch > 0) it
    also holds `length`, the flattened `length_sums` of this forward's ratios (summed over them later)."""
    cfg = ctx.cfg
    R = batch.response_mask_BR.shape[1]
    replay = {
        "off": lambda: None,
        "old": lambda: old_trace,
        "rollout": lambda: _sampler_trace(batch, sl),
    }[cfg.routing.replay]()
    ctx.model.train()
    ids_bS, attn_bS = batch.input_ids_BS[sl], batch.attention_mask_BS[sl]
    temperature = cfg.sampler.temperature or 1.0
    aux_coef = cfg.model.router_aux_loss_coef
    drift_ctx = drifting(ctx.cfg.routing, ctx.controller, ctx.cfg.seed, step, minibatch)
    with (
        # mini-batch 2's logit shift; every mini-batch's under RSPO
        ctx.controller.record(with_logits=minibatch == 1 or cfg.objective.router_shift) as rec,
        _replaying(ctx, replay),
        drift_ctx if drift_ctx is not None else contextlib.nullcontext() as drift,
        noising(ctx.cfg.routing, ctx.controller, ctx.cfg.seed, step, batch, sl, "update", minibatch),
    ):
        logp_bR, aux_loss = response_logprobs_and_aux(
            ctx.train_model, ids_bS, attn_bS, R, temperature, with_aux=aux_coef > 0, support=batch.support_of(sl)
        )
    change = _routing_change(ctx, batch, sl, rec.trace, old_trace, drift)
    ref_logp = None
    if ctx.ref_model is not None:
        with torch.no_grad():
            ref_logp = response_logprobs(ctx.ref_model, ids_bS, attn_bS, R, temperature)
    shift_bR, shift_stats = None, {}
    if cfg.objective.router_shift:
        shift_bR, shift_stats = _router_shift(ctx, batch, sl, rec.trace, old_trace)
    loss, metrics = _objective(ctx, batch, sl, logp_bR, old_logp_bR, ref_logp, shift_bR)
    metrics.update(shift_stats)
    if minibatch > 0:  # the first mini-batch is on-policy: every ratio is 1 there
        bins = length_bins(cfg.sampler.max_new_tokens)
        change["length"] = length_sums(logp_bR, old_logp_bR, batch.response_mask_BR[sl], bins).flatten().tolist()
    if aux_loss is not None:  # the family's load-balancing loss (model.router_aux_loss_coef > 0)
        loss = loss + aux_coef * aux_loss
        metrics["train/aux_loss"] = S.scalar(aux_loss.item())
    loss = loss * loss_scale
    metrics["train/loss"] = S.scalar(loss.item())
    metrics.update(_grad_metrics(_optimizer_step(ctx, step, loss, minibatch), cfg.trainer.grad_clip))
    return S.Finished(metrics), change


def _grad_metrics(grad_norm: float, clip: float | None) -> S.Stats:
    """The gradient norm before clipping (mean and max over mini-batches), the fraction of updates that
    clipping scaled down, and the scale min(1, clip / norm) it applied (1 without clipping). A skipped,
    non-finite update counts in neither the clipped fraction nor the scale."""
    finite = math.isfinite(grad_norm)
    scale = 1.0 if clip is None or not finite else min(1.0, clip / max(grad_norm, 1e-12))
    return {
        "train/grad_norm": S.scalar(grad_norm),
        "train/grad_norm/max": S.Stat("max", (grad_norm if finite else math.nan,)),
        "train/grad_clipped_frac": S.Stat("mean", (float(scale < 1.0), 1.0) if finite else (0.0, 0.0)),
        "train/grad_clip_scale": S.Stat("mean", (scale, 1.0) if finite else (0.0, 0.0)),
    }


def rl_step(ctx: StepContext, step: int) -> dict[str, float]:
    """Run one RL step and return its metrics (see the metric table in moe_rl/trainer/__init__.py).

    Under data parallelism every rank returns the same metrics, reduced over ranks.
    """
    cfg, t, d = ctx.cfg, ctx.cfg.trainer, ctx.dist
    t0 = time.perf_counter()
    roll, rewards_B, failed_B = _rollout(ctx, step)
    adv_B = group_advantages(rewards_B, t.group_size, normalize_std=cfg.objective.normalize_std)
    # This rank's runs of M rows in every mini-batch, as indices into its own rows.
    unit = t.group_size if t.group_minibatches else 1
    rows_MC = minibatch_rows(t.prompts_per_step * t.group_size, t.mini_batches, ctx.shuffle_gen, unit)
    c = rows_MC.shape[1] // d.world
    perm_B = (rows_MC[:, d.rank * c : (d.rank + 1) * c] - d.rank * len(rewards_B)).reshape(-1)
    dev = roll.logp_BR.device
    batch = Batch.from_rollout(roll, adv_B.to(dev), perm_B.to(dev), d.rank * len(rewards_B))
    slices = [slice(j * c, (j + 1) * c) for j in range(t.mini_batches)]
    t1 = time.perf_counter()
    if t.reuse_sampler_logp:  # the sampler ran these weights at this precision: its results are in hand
        old_logps = [batch.sampler_logp_BR[sl] for sl in slices]
        old_traces = [batch.sampler_trace.rows(sl) for sl in slices]
    else:
        old_logps, old_traces = _old_policy(ctx, batch, slices, step)
    old_trace = RoutingTrace.cat(old_traces)
    t2 = time.perf_counter()

    per_mb, changes = [], []
    for j, scale in enumerate(_loss_scales(ctx, batch, slices)):
        m, change = _update(ctx, step, batch, slices[j], old_logps[j], old_traces[j], scale, minibatch=j)
        per_mb.append(m)
        changes.append(change)
    sync_s = ctx.sync_sampler()
    t3 = time.perf_counter()

    local = routing_metrics(batch, old_trace, torch.cat(old_logps), cfg.routing.replay)
    local.update(minibatch_overlap(batch, perm_B // t.group_size, slices))
    tokens = int(batch.valid_BS1.sum()) + len(perm_B)
    local.update(
        {
            "time/step_s": t3 - t0,
            "time/rollout_s": t1 - t0,
            "time/old_forward_s": t2 - t1,
            "time/train_s": t3 - t2,
            "throughput/tokens_per_s": tokens / (t3 - t0),
            "throughput/sampler_tokens_per_s": int(roll.response_mask_BR.sum()) / (t1 - t0),
        }
    )
    if sync_s is not None:
        local["time/weight_sync_s"] = sync_s
    margins = response_margins(old_trace, _response_positions(batch, slice(None)), ctx.controller.top_k)
    metrics, per_mb = _reduced_metrics(
        ctx, roll, (rewards_B, failed_B), batch, slices, per_mb, changes, local, margins
    )
    ctx.detector.observe(step, {**metrics, **ratio_extremes(per_mb)})
    metrics["collapse/events"] = float(len(ctx.detector.events))
    metrics["collapse/new_events"] = float(sum(1 for e in ctx.detector.events if e.step == step))
    return metrics


def _reduced_metrics(
    ctx: StepContext,
    roll: Rollout,
    scores: tuple[torch.Tensor, torch.Tensor],
    batch: Batch,
    slices: list[slice],
    per_mb: list[S.Finished],
    changes: list[dict[str, list[float]]],
    local: dict[str, float],
    margins: list[list[float]] | None,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """The step's metrics over all ranks (one gather; identical on every rank), and each mini-batch's.

    `scores` is (rewards_B, failed_B) of this rank's rows. Each mini-batch's objective stats are pooled
    over ranks exactly (moe_rl.stats.combine: whatever the key), then finished; the step's value is their
    mean over mini-batches (`*/sum`: their sum)."""
    mask_BR = roll.response_mask_BR
    rewards_B, failed_B = scores
    rows = [
        rewards_B.double(),
        mask_BR.sum(1).double().cpu(),
        (roll.entropy_BR * mask_BR).sum(1).double().cpu(),
        failed_B,
    ]
    ranks = ctx.dist.gather(
        {
            "rows": torch.stack(rows, 1).tolist(),
            "per_mb": [m.stats for m in per_mb],
            "changes": changes,
            "mb_counts": [_counts(batch, sl) for sl in slices],
            "local": local,
            "counts": _counts(batch, slice(None)),
            "margins": margins,
        }
    )
    metrics = rollout_metrics([row for r in ranks for row in r["rows"]], ctx.cfg.trainer.group_size,
                              ctx.task.reward_can_fail)
    M = len(slices)
    mb_counts = [[r["mb_counts"][j] for r in ranks] for j in range(M)]
    per_mb = [S.values(S.combine([r["per_mb"][j] for r in ranks])) for j in range(M)]
    metrics.update(over_minibatches(per_mb))
    metrics["train/lr"] = ctx.scheduler.get_last_lr()[0]
    # Each mini-batch's expert change over all ranks: per layer a mean over valid positions, over the
    # response a mean over response tokens.
    def over_ranks(j: int, key: str, weight: str) -> torch.Tensor:
        pairs = list(zip(ranks, mb_counts[j], strict=True))
        total = sum(torch.tensor(r["changes"][j][key]) * c[weight] for r, c in pairs)
        return total / max(sum(c[weight] for _, c in pairs), 1.0)

    layers = [over_ranks(j, "layers", "positions") for j in range(M)]
    response = [float(over_ranks(j, "response", "tokens")) for j in range(M)]
    metrics.update(change_metrics(layers, response))
    if "rollout" in changes[0]:
        metrics["routing/rollout_vs_current/frac"] = finite_mean(
            [float(over_ranks(j, "rollout", "positions")) for j in range(M)]
        )
    if "drift" in changes[0]:  # over the mini-batches that drift (all ranks): swapped / valid slots
        first = ctx.cfg.routing.drift_from_minibatch - 1
        swapped_slots = [r["changes"][j]["drift"] for r in ranks for j in range(first, M)]
        slots = sum(n for _, n in swapped_slots)
        metrics["routing/drift/applied_frac"] = sum(k for k, _ in swapped_slots) / slots if slots else 0.0
    # Ratio statistics by response length, pooled over mini-batches 2..M of all ranks: sums, so exact.
    bins = length_bins(ctx.cfg.sampler.max_new_tokens)
    sums = torch.zeros(len(bins) * len(LENGTH_SUMS), dtype=torch.float64)
    for change in (c for r in ranks for c in r["changes"][1:]):
        sums += torch.tensor(change["length"], dtype=torch.float64)
    metrics.update(length_metrics(sums.view(len(bins), -1), bins))
    if margins is not None:  # every rank's margins, pooled: exact order statistics
        shift = [r["changes"][1]["shift"] for r in ranks] if M > 1 else []
        metrics.update(margin_metrics([m for r in ranks for m in r["margins"]], shift, ctx.cfg.routing,
                                      ctx.controller.top_k))
    metrics.update(reduce_metrics([r["local"] for r in ranks], [r["counts"] for r in ranks]))
    return metrics, per_mb


def _response_positions(batch: Batch, sl: slice) -> torch.Tensor:
    """`[b, S1]` bool: the forward positions whose next-token prediction is a response token (the R
    positions that produce the response log-probs), where the paper's expert change is meant."""
    mask_bR = batch.response_mask_BR[sl]
    b, S1 = batch.valid_BS1[sl].shape
    return torch.cat([mask_bR.new_zeros(b, S1 - mask_bR.shape[1]), mask_bR], dim=1)


def _counts(batch: Batch, sl: slice) -> dict[str, float]:
    """Rows, response tokens and valid forward positions of a slice of the batch (metric weights)."""
    return {
        "rows": float(batch.response_mask_BR[sl].shape[0]),
        "tokens": float(batch.response_mask_BR[sl].sum()),
        "positions": float(batch.valid_BS1[sl].sum()),
    }


