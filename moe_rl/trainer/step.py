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
sampler all see the same experts. Which routing each forward uses (replay, noise, drift) is the step's
`RoutingPlan` (plan.py), the one place that decides it; what samples is the context's `Sampler`
(samplers.py); what the phases return is typed and reduced once (reduce.py).

    rl_step(ctx, step)
      ctx.sampler.rollout -> Batch.build -> RoutingPlan -> old_policy -> update x M -> ctx.sampler.sync
      -> step_record -> reduce_step -> ctx.detector.observe

Only rl_step reads the whole context. Each phase takes the fields it reads: the forwards (`Forwards`:
policy, update wrapper, routers, reference, temperature, aux weight), the optimizer step (`Stepper`), the
objective (`ObjectiveSettings`) and the metrics' settings (`MetricSettings`), each built from the context.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moe_rl import reduction as S
from moe_rl.config import Config
from moe_rl.objectives import OBJECTIVES, ObjectiveInputs, TopK
from moe_rl.objectives.common import length_bins, length_sums
from moe_rl.objectives.config import ObjectiveConfig
from moe_rl.objectives.router_shift import router_shift_ratio
from moe_rl.rollout import response_logprobs, response_logprobs_and_aux
from moe_rl.routing import RoutingController, RoutingTrace
from moe_rl.tasks import Task
from moe_rl.trainer.batch import Batch
from moe_rl.trainer.collapse import CollapseDetector
from moe_rl.trainer.distributed import Dist
from moe_rl.trainer.ess_scale import ess_factor, scaled_lr
from moe_rl.trainer.plan import RoutingPlan, drift_minibatches, noise_sigma
from moe_rl.trainer.reduce import (
    Counts,
    MetricSettings,
    MinibatchResult,
    StepRecord,
    reduce_step,
    response_positions,
    routing_change,
)
from moe_rl.trainer.samplers import Sampler, Shard, chat_prompt
from moe_rl.trainer.step_metrics import (
    minibatch_overlap,
    mismatch_metrics,
    replace_rate,
    response_margins,
    routing_metrics,
    staleness_metrics,
)


@dataclass
class StepContext:
    """What a step needs besides the config: the policy, its routers, the sampler, the optimiser and RNGs."""

    cfg: Config
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    controller: RoutingController
    task: Task
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sample_gen: torch.Generator
    """The hf samplers' generator (re-seeded every step; checkpointed with the run)."""
    shuffle_gen: torch.Generator
    detector: CollapseDetector
    sampler: Sampler
    """What samples the rollouts and takes the weights after each step (samplers.py)."""
    ref_model: PreTrainedModel | None = None
    dist: Dist = field(default_factory=Dist)
    """This process's rank and the job's size; a single process by default."""
    train_model: nn.Module | None = None
    """What the update forward calls: the DDP wrapper (its backward averages gradients over ranks), else
    the model itself (None). Sampling and old-policy forwards call `model`, which is never a wrapper."""
    sharded: bool = False
    """The policy is FSDP2-sharded: its every forward is a collective, so ranks sample in lock-step."""
    objective: ObjectiveSettings | None = None
    """The objective's settings, read once from the config (None: from `cfg`)."""
    metric_settings: MetricSettings | None = None
    """What the step's metrics read of the run's settings, once (None: from `cfg`, the task and the routers)."""

    def __post_init__(self) -> None:
        if self.train_model is None:
            self.train_model = self.model
        if self.objective is None:  # an inexact sampler's log-probs differ from the old policy's (samplers.py)
            self.objective = ObjectiveSettings.of(self.cfg, mismatch=not self.sampler.exact)
        if self.metric_settings is None:
            t = self.cfg.trainer
            self.metric_settings = MetricSettings(
                group_size=t.group_size,
                reward_can_fail=self.task.reward_can_fail,
                max_new_tokens=self.cfg.sampler.max_new_tokens,
                top_k=self.controller.top_k,
                noise_sigma=noise_sigma(self.cfg.routing, 1),
                drift_minibatches=drift_minibatches(self.cfg.routing, t.mini_batches),
            )

    @property
    def shard(self) -> Shard:
        return Shard(self.dist.rank, self.dist.world)

    @property
    def forwards(self) -> Forwards:
        """What the old-policy and update phases run their forwards with."""
        return Forwards(self.model, self.train_model, self.controller, self.ref_model,
                        self.cfg.sampler.temperature or 1.0, self.cfg.model.router_aux_loss_coef,
                        self.cfg.trainer.reuse_sampler_logp)

    @property
    def stepper(self) -> Stepper:
        """What an optimizer step touches."""
        t = self.cfg.trainer
        return Stepper(self.model, self.optimizer, self.scheduler, self.dist, self.detector, t.grad_clip,
                       t.ess_step_scale)

    def prompt(self, text: str) -> str:
        """A task prompt as the model sees it: plain, or one user turn of the chat template (task.chat_template)."""
        return chat_prompt(self.tokenizer, text) if self.cfg.task.chat_template else text


@dataclass(frozen=True)
class Forwards:
    """The policy's forwards, as the old-policy and update phases read them."""

    model: PreTrainedModel
    """Sampling and old-policy forwards call it (never a wrapper)."""
    train_model: nn.Module
    """The update forward calls it: the DDP wrapper, else `model`."""
    controller: RoutingController
    ref_model: PreTrainedModel | None
    temperature: float
    """sampler.temperature (0, greedy, scores at 1)."""
    aux_coef: float
    """model.router_aux_loss_coef: the load-balancing loss's weight in the update (0: not computed)."""
    old_from_sampler: bool
    """trainer.reuse_sampler_logp: the sampler ran these weights at this precision, so its log-probs and
    routing are the old policy's."""


@dataclass(frozen=True)
class Stepper:
    """What an optimizer step touches: backward, clip, step and the lr schedule, decided alike on every rank."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dist: Dist
    detector: CollapseDetector
    """Notes a non-finite loss or gradient norm."""
    grad_clip: float | None
    ess_step_scale: str
    """trainer.ess_step_scale: off, sqrt or linear (ess_scale.py)."""


@dataclass(frozen=True)
class ObjectiveSettings:
    """The configured objective, handed its config whole, and what the trainer adds on every mini-batch."""

    cfg: ObjectiveConfig
    max_len: int
    """sampler.max_new_tokens, the constant of seq-mean-token-sum-norm."""
    mismatch: bool
    """Log the sampler-mismatch diagnostics (a sampler at another precision, vLLM, or a stale one)."""

    @classmethod
    def of(cls, cfg: Config, mismatch: bool) -> ObjectiveSettings:
        return cls(cfg.objective, cfg.sampler.max_new_tokens, mismatch)

    def __call__(
        self,
        logp_bR: torch.Tensor,
        old_logp_bR: torch.Tensor,
        adv_b: torch.Tensor,
        mask_bR: torch.Tensor,
        *,
        ref_logp: torch.Tensor | None,
        sampler_logp: torch.Tensor,
        router_shift: torch.Tensor | None,
        topk: TopK | None = None,
    ) -> tuple[torch.Tensor, S.Stats]:
        """The objective's (loss, stats) on one mini-batch: the one registry lookup."""
        inputs = ObjectiveInputs(
            logp_bR, old_logp_bR, adv_b, mask_bR, cfg=self.cfg, max_len=self.max_len, ref_logp=ref_logp,
            sampler_logp=sampler_logp, mismatch_diagnostics=self.mismatch, router_shift=router_shift, topk=topk,
        )
        return OBJECTIVES[self.cfg.name].compute(inputs)


@dataclass
class OldPolicy:
    """The old policy's log-probs and routing (with logits), per mini-batch."""

    logps: list[torch.Tensor]
    traces: list[RoutingTrace]

    @property
    def trace(self) -> RoutingTrace:
        return RoutingTrace.cat(self.traces)

    @property
    def logp_BR(self) -> torch.Tensor:
        return torch.cat(self.logps)


@torch.no_grad()
def old_policy(fw: Forwards, batch: Batch, plan: RoutingPlan) -> OldPolicy:
    """Old-policy log-probs and routing (with logits), one forward per mini-batch, in the plan's routing:
    under R3 it replays the sampler's routing (its trace is then the routers' free choice given the
    replayed layers above, what expert change is measured against); under scope-trainer noise it is
    perturbed. With trainer.reuse_sampler_logp the sampler ran these weights at this precision: its
    log-probs and routing are taken as they are."""
    if fw.old_from_sampler:
        return OldPolicy([batch.sampler_logp_BR[sl] for sl in batch.minibatches],
                         [batch.sampler_trace.rows(sl) for sl in batch.minibatches])
    R = batch.response_mask_BR.shape[1]
    logps, traces = [], []
    for sl in batch.minibatches:
        with fw.controller.record(with_logits=True, with_gates=plan.records_gates) as rec, plan.old(sl):
            logps.append(response_logprobs(fw.model, batch.input_ids_BS[sl], batch.attention_mask_BS[sl], R,
                                           fw.temperature, batch.support_of(sl)))
        traces.append(rec.trace)
    return OldPolicy(logps, traces)


def loss_scales(dist: Dist, batch: Batch, loss_agg: str) -> list[float]:
    """Per mini-batch, the factor on this rank's loss that makes the average over ranks (DDP's gradient
    average) the global mini-batch loss. Every rank holds as many rows of each mini-batch, so it is 1 when
    the loss is a mean over sequences; token-mean divides by the token count, which differs, so there it
    is W x this rank's tokens / all ranks' tokens. A collective."""
    if loss_agg != "token-mean":
        return [1.0] * len(batch.minibatches)
    tokens = [float(batch.response_mask_BR[sl].sum()) for sl in batch.minibatches]
    totals = dist.sum(tokens)
    return [dist.world * n / max(total, 1.0) for n, total in zip(tokens, totals, strict=True)]


def update(
    fw: Forwards,
    st: Stepper,
    objective: ObjectiveSettings,
    batch: Batch,
    old: OldPolicy,
    plan: RoutingPlan,
    j: int,
    loss_scale: float = 1.0,
) -> MinibatchResult:
    """One optimizer step on mini-batch j (0-based) in the plan's routing; returns its stats (which keep
    their moe_rl.reduction for the exact reduction over ranks), its routing change (the routing this forward
    used absent replay, free or drifted, against the old policy's) and its counts."""
    ocfg = objective.cfg
    sl, old_logp_bR, old_trace = batch.minibatches[j], old.logps[j], old.traces[j]
    R = batch.response_mask_BR.shape[1]
    fw.model.train()
    ids_bS, attn_bS = batch.input_ids_BS[sl], batch.attention_mask_BS[sl]
    temperature, aux_coef = fw.temperature, fw.aux_coef
    with (
        # mini-batch 2's logit shift; every mini-batch's under RSPO
        fw.controller.record(with_logits=j == 1 or ocfg.router_shift) as rec,
        plan.update(j, sl, old_trace) as used,
    ):
        topk_ids = None if batch.topk_ids_BRK is None else batch.topk_ids_BRK[sl]
        logp_bR, aux_loss, topk_logp = response_logprobs_and_aux(
            fw.train_model, ids_bS, attn_bS, R, temperature, with_aux=aux_coef > 0, support=batch.support_of(sl),
            topk_ids_BRK=topk_ids,
        )
    change = routing_change(batch, sl, rec.trace, old_trace, used.drift, fw.controller.num_layers,
                            plan.measures_drift())
    ref_logp = None
    if fw.ref_model is not None:
        with torch.no_grad():
            ref_logp = response_logprobs(fw.ref_model, ids_bS, attn_bS, R, temperature)
    shift_bR, shift_stats = None, {}
    if ocfg.router_shift:  # RSPO's γ̃ [b, R] from the traces, not a second forward
        shift_bR, shift_stats = router_shift_ratio(
            rec.trace.router_logits_BTLE[:, -R:],  # the R positions that predict response tokens
            old_trace.router_logits_BTLE[:, -R:],
            plan.activated(sl, old_trace).expert_ids_BTLK[:, -R:],
            batch.response_mask_BR[sl],
            ocfg.router_shift_floor,
        )
    top = None if topk_logp is None else TopK(batch.topk_logp_BRK[sl], topk_logp)
    loss, metrics = objective(
        logp_bR, old_logp_bR, batch.adv_B[sl], batch.response_mask_BR[sl],
        ref_logp=ref_logp, sampler_logp=batch.sampler_logp_BR[sl], router_shift=shift_bR, topk=top,
    )
    metrics.update(shift_stats)
    if plan.partial():  # replaced over replayed slots at valid positions, pooled and per layer
        metrics.update(replace_rate(used.replay.replaced_BTL, batch.valid_BS1[sl].cpu(), fw.controller.top_k))
    if j > 0:  # the first mini-batch is on-policy: every ratio is 1 there
        bins = length_bins(objective.max_len)
        change.length = length_sums(logp_bR, old_logp_bR, batch.response_mask_BR[sl], bins).flatten().tolist()
    if aux_loss is not None:  # the family's load-balancing loss (model.router_aux_loss_coef > 0)
        loss = loss + aux_coef * aux_loss
        metrics["train/aux_loss"] = S.scalar(aux_loss.item())
    loss = loss * loss_scale
    metrics["train/loss"] = S.scalar(loss.item())
    lr_factor = 1.0
    if st.ess_step_scale != "off":  # VCPO: this step's lr by the mini-batch's ESS (ess_scale.py)
        lr_factor = ess_factor(old_logp_bR, batch.sampler_logp_BR[sl], batch.response_mask_BR[sl],
                               st.ess_step_scale, st.dist)
        metrics["train/ess_lr_factor"] = S.scalar(lr_factor)
    metrics.update(grad_metrics(optimizer_step(st, plan, loss, j, lr_factor), st.grad_clip))
    return MinibatchResult(S.to_floats(metrics), change, Counts.of(batch, sl))


def optimizer_step(st: Stepper, plan: RoutingPlan, loss: torch.Tensor, j: int, lr_factor: float = 1.0) -> float:
    """Backward, clip and step (at every group's lr times `lr_factor`, restored after it: ess_scale.py);
    returns the gradient norm (nan when the loss was not finite). A non-finite loss or gradient norm skips
    the update and is noted with the collapse detector. After a step, the plan's router-weight noise
    (routing.weight_noise)."""
    # Every rank must skip or take the update alike (a backward is a collective): decide on the sum.
    loss_sum = st.dist.sum([loss.item()])[0]
    if not math.isfinite(loss_sum):
        st.detector.nonfinite(plan.step, loss_sum / st.dist.world, "train/loss")
        return math.nan
    st.dist.collective(loss.backward)  # DDP and FSDP reduce gradients across ranks in backward
    clip = st.grad_clip
    norm = torch.nn.utils.clip_grad_norm_(st.model.parameters(), math.inf if clip is None else clip)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
    if math.isfinite(grad_norm):
        with scaled_lr(st.optimizer, lr_factor):
            st.optimizer.step()
        plan.after_update(st.optimizer, j)
    else:
        st.detector.nonfinite(plan.step, grad_norm, "train/grad_norm")
    st.optimizer.zero_grad(set_to_none=True)
    st.scheduler.step()
    return grad_norm


def grad_metrics(grad_norm: float, clip: float | None) -> S.Stats:
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
    """Run one RL step and return its metrics (see the metric table in moe_rl/trainer/__init__.py); the
    run adds the evaluation's and the `collapse/*` counts (moe_rl/trainer/run.py), once the step's events
    are all known.

    Under data parallelism every rank returns the same metrics, reduced over ranks.
    """
    cfg, t = ctx.cfg, ctx.cfg.trainer
    t0 = time.perf_counter()
    roll, scores = ctx.sampler.rollout(ctx.task, step, ctx.shard)
    batch = Batch.build(roll, scores.rewards_B, group_size=t.group_size, mini_batches=t.mini_batches,
                        group_minibatches=t.group_minibatches, normalize_std=cfg.objective.normalize_std,
                        shuffle_gen=ctx.shuffle_gen, dist=ctx.dist)
    plan = RoutingPlan(cfg.routing, ctx.controller, batch, step, cfg.seed)
    t1 = time.perf_counter()
    fw, st = ctx.forwards, ctx.stepper
    old = old_policy(fw, batch, plan)
    t2 = time.perf_counter()
    scales = loss_scales(ctx.dist, batch, cfg.objective.loss_agg)
    results = [update(fw, st, ctx.objective, batch, old, plan, j, scales[j]) for j in range(t.mini_batches)]
    sync_s = ctx.sampler.sync(ctx.model)
    t3 = time.perf_counter()
    record = step_record(ctx.metric_settings, roll, batch, old, plan, (t0, t1, t2, t3), sync_s)
    metrics, extremes = reduce_step(ctx.dist, roll, scores, results, record, ctx.metric_settings,
                                    ctx.scheduler.get_last_lr()[0])
    ctx.detector.observe(step, {**metrics, **extremes})
    return metrics


def step_record(
    settings: MetricSettings,
    roll,
    batch: Batch,
    old: OldPolicy,
    plan: RoutingPlan,
    times: tuple[float, float, float, float],
    sync_s: float | None,
) -> StepRecord:
    """This rank's own scalars of the step (routing statistics, mini-batch overlap, stage times and
    throughputs, each with its reduction) and what `reduce_step` reads beside the results."""
    t0, t1, t2, t3 = times
    old_trace = old.trace
    local = routing_metrics(batch, old_trace, old.logp_BR, plan.replay_cache_bytes(old_trace))
    local.update(minibatch_overlap(batch, batch.perm_B // settings.group_size, batch.minibatches))
    local.update(mismatch_metrics(old.logp_BR, batch.sampler_logp_BR, roll.entropy_BR[batch.perm_B],
                                  batch.response_mask_BR))
    sampler_shift = None
    if roll.version is not None:  # a stale sampler's rollout (rollout.staleness)
        stale, sampler_shift = staleness_metrics(batch, old_trace, response_positions(batch, slice(None)),
                                                 plan.step - roll.version)
        local.update(stale)
    tokens = int(batch.valid_BS1.sum()) + len(batch.perm_B)
    seconds = {"time/step_s": t3 - t0, "time/rollout_s": t1 - t0, "time/old_forward_s": t2 - t1,
               "time/train_s": t3 - t2}
    if sync_s is not None:
        seconds["time/weight_sync_s"] = sync_s
    local.update({key: S.Stat("max", (s,)) for key, s in seconds.items()})  # the slowest rank's
    local["throughput/tokens_per_s"] = S.Stat("sum", (tokens / (t3 - t0),))
    sample_s = t1 - t0 if roll.sample_s is None else roll.sample_s  # a stale rollout's own sampling time
    local["throughput/sampler_tokens_per_s"] = S.Stat("sum", (int(roll.response_mask_BR.sum()) / sample_s,))
    return StepRecord(
        local=local,
        margins=response_margins(old_trace, response_positions(batch, slice(None)), settings.top_k),
        sampler_shift=sampler_shift,
    )
