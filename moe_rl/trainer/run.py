"""A whole run: build (or warm-start) the policy, loop over RL steps, log, checkpoint, resume.

    train            check the config and the machine, start the ranks, claim the folder (folder.claim)
      _train         plan_resume -> record_start -> build_context -> Checkpointer.load -> the MetricSink
        _steps       each step: rl_step -> Evaluator.due/run -> collapse_metrics -> sink.log/event
                     -> Checkpointer.save(step, last)
        _summary     -> sink.finish: summary.json and W&B's run summary

Each concern of the loop is one object with a verb, as in torchtitan's train.py: the `Checkpointer`
(checkpointer.py: the resume decision, checkpoints and the policy's export), the `Evaluator`
(evaluate.py), the `MetricSink` (logging.py: metrics.jsonl, events.jsonl, summary.json, W&B and its
alerts; a `NullSink` on ranks other than 0). `build_context` assembles what a step needs: the initial
policy (policy.py), its sampler (sampling.py: `build_sampler`) and optimiser.

The policy is also written in Hugging Face format to `policy/` at the end of the run (and at every
checkpoint with `trainer.export_hf=true`; moe_rl/trainer/export.py).

Under `torchrun` with several processes (moe_rl.trainer.distributed) every rank runs `train`; only rank
0 writes metrics, events, the summary, checkpoints and W&B, into rank 0's run folder. Every rank's RNGs
are in the same state after a step (the sampling generator is re-seeded from (seed, step) and every
rank draws the same mini-batches), so a checkpoint holds rank 0's, and every rank loads it on resume.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moe_rl.config import Config
from moe_rl.objectives import OBJECTIVES
from moe_rl.provenance import provenance
from moe_rl.routing import RoutingController, float32_routers
from moe_rl.startup import (
    check_chat_template,
    check_config,
    check_launch,
    check_machine,
    check_world,
    load_task,
)
from moe_rl.tasks import Task
from moe_rl.trainer.checkpointer import Checkpointer, plan_resume, record_start
from moe_rl.trainer.collapse import CollapseDetector, CollapseEvent, collapse_metrics, stop_event
from moe_rl.trainer.distributed import Dist, init_distributed, param_checksum, shard, wrap
from moe_rl.trainer.evaluate import Evaluator
from moe_rl.trainer.folder import claim
from moe_rl.trainer.logging import MetricSink, NullSink, from_json_number, metric_sink, read_jsonl
from moe_rl.trainer.policy import initial_policy
from moe_rl.trainer.precision import make_optimizer, router_param_groups
from moe_rl.trainer.samplers import Draws, chat_prompt
from moe_rl.trainer.sampling import build_sampler
from moe_rl.trainer.stale import thread_split
from moe_rl.trainer.step import StepContext, rl_step


def run_label(cfg: Config) -> str:
    """How a run is named in tables and W&B: objective preset and replay source, from the config."""
    return f"{cfg.objective.preset} (replay={cfg.routing.replay})"


def build_context(cfg: Config, dist: Dist | None = None, task: Task | None = None) -> tuple[StepContext, dict]:
    """Everything an RL step needs (the policy, its routers, the sampler, the optimiser, the RNGs), and
    what the run reports of its warm start; under torchrun, this rank's share. `task`: the run's task when
    the entry point already built it (its start-up check), so a user's reward function is probed once."""
    dist = dist or Dist()
    check_launch(cfg, dist.world)  # before the warm start: a missing extra or launcher fails at once
    torch.manual_seed(cfg.seed)
    task = task if task is not None else load_task(cfg)
    model, tokenizer, ws = initial_policy(cfg, cfg.logger.progress and dist.main, task)
    check_chat_template(cfg, tokenizer)
    if cfg.model.router_dtype == "float32":
        float32_routers(model)
    t = cfg.trainer
    sharded = dist.world > 1 and t.parallel == "fsdp"
    if not sharded:  # FSDP2 moves each layer's shard to this rank's device as it shards it
        model.to(torch.device(t.device))
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.objective.beta > 0 else None
    controller = RoutingController(model)
    if cfg.routing.freeze_router:  # total router recall: the routers never change (before DDP and the optimizer)
        for router in controller.routers:
            router.requires_grad_(False)
    sample_gen = torch.Generator(torch.device(t.device)).manual_seed(cfg.seed)
    prompt = functools.partial(chat_prompt, tokenizer) if cfg.task.chat_template else (lambda text: text)
    draws = Draws(cfg.seed, t.prompts_per_step, t.group_size, prompt)
    sampler = build_sampler(cfg, model, tokenizer, controller, draws, sample_gen, dist, sharded)
    train_model = wrap(model, t.parallel, dist, t.device)
    if sharded and ref is not None:
        shard(ref)
    # After wrap: FSDP2 replaces the parameters by their shards, which the optimizer must hold.
    # Fused: one kernel per parameter instead of a dozen ops (an optimizer step of the tiny model went
    # from 8.8 ms to 2.3 ms on 2 CPU cores); FSDP2's sharded parameters take the default implementation.
    optimizer = make_optimizer(
        router_param_groups(model, controller.routers, t.lr, t.router_lr_scale),
        getattr(torch, cfg.model.dtype),
        t.master_weights,
        lr=t.lr,
        weight_decay=t.weight_decay,
        fused=True if not sharded else None,
    )
    # Not transformers' get_constant_schedule_with_warmup: it counts from 0, so the first optimizer step
    # (the on-policy mini-batch) would run at lr 0. Here step s runs at (s + 1) / warmup of the peak.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, t.warmup_steps))
    )
    ctx = StepContext(
        cfg,
        model,
        tokenizer,
        controller,
        task,
        optimizer,
        scheduler,
        sample_gen,
        torch.Generator().manual_seed(cfg.seed + 1),
        CollapseDetector(cfg.collapse, ratio=OBJECTIVES[cfg.objective.name].ratio),
        sampler,
        ref_model=ref,
        dist=dist,
        train_model=train_model,
        sharded=sharded,
    )
    # One forward on a task prompt checks every router's gate function now, before any compute: a family
    # whose gates the controller cannot rebuild fails here in one line (UnsupportedRouterError).
    probe = ctx.prompt(ctx.task.examples("train", 1, seed=0)[0].prompt)
    probe_ids = tokenizer(probe, return_tensors="pt").input_ids.to(t.device)
    ctx.controller.verify_gates(model, probe_ids)
    sampler.verify(model, ctx.controller, probe, probe_ids)
    info = {"warmstart_accuracy": ws.accuracy if ws else None, "warmstart_path": str(ws.path) if ws else None}
    return ctx, info


def train(
    cfg: Config,
    run_dir: Path,
    *,
    wandb_group: str | None = None,
    hydra_record: dict[str, str] | None = None,
    task: Task | None = None,
) -> dict:
    """Run RL as configured, writing metrics.jsonl, events.jsonl, summary.json and checkpoints to run_dir.

    Rank 0 holds the folder's lock for the whole run, and a fresh run into a folder that holds one is
    refused unless cfg.overwrite (moe_rl.trainer.folder). `hydra_record` (Hydra's .hydra/*.yaml texts, from
    the entry point) is written once the run is accepted, so a refused run leaves the folder as it was.
    Under torchrun every rank calls this and gets the same summary; rank 0 writes (module docstring).
    `task`: the run's task when the entry point built it for its start-up check (built once, probed once).
    """
    check_config(cfg)
    check_machine(cfg)
    dist, device = init_distributed(cfg.trainer)
    check_world(cfg.trainer, dist.world)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, device=device))
    run_dir = Path(dist.broadcast(str(run_dir)))  # Hydra's timestamped folder may differ by a second
    with claim(run_dir, dist, resume=cfg.resume, overwrite=cfg.overwrite):
        return _train(cfg, run_dir, dist, wandb_group, hydra_record or {}, task)


def _train(cfg: Config, run_dir: Path, dist: Dist, wandb_group: str | None, hydra_record: dict[str, str],
           task: Task | None = None) -> dict:
    """`train` in a claimed folder: resume or start, the steps (`_steps`), the summary."""
    resume = plan_resume(cfg, run_dir, dist)  # before any compute or write: a refused resume stops here
    if resume.finished is not None:
        dist.close()
        return resume.finished
    rid = record_start(run_dir, dist, resume, hydra_record)
    threads = thread_split(cfg.trainer.threads, cfg.rollout.sampler_threads)[0] if cfg.rollout.overlap else cfg.trainer.threads
    if threads:
        torch.set_num_threads(threads)
    origin = provenance(cfg.trainer.device)  # after the thread count is set: it is part of the record
    ctx, info = build_context(cfg, dist, task)
    checkpointer = Checkpointer(run_dir, ctx, resume, rid)
    start = checkpointer.load()
    sink = NullSink() if not dist.main else metric_sink(
        run_dir, cfg.logger, start if resume.state else None, {**dataclasses.asdict(cfg), "provenance": origin},
        group=cfg.logger.group or wandb_group or cfg.experiment, name=f"{run_label(cfg)} seed={cfg.seed}",
        tags=[cfg.objective.preset, f"replay={cfg.routing.replay}", cfg.experiment],
        past_events=[dataclasses.asdict(e) for e in ctx.detector.events])
    t0 = time.perf_counter()
    evaluator = Evaluator(ctx.model, ctx.tokenizer, ctx.task, ctx.prompt, cfg.sampler, cfg.eval)
    with contextlib.closing(ctx.sampler):  # stops a background sampler (rollout.overlap) however the loop ends
        done = _steps(ctx, start, evaluator, checkpointer, sink)
        # The last collective, before the sampler closes: a vLLM engine leaves the process group as it shuts down.
        checksums = dist.gather(param_checksum(ctx.model))
    summary = _summary(cfg, run_dir, dist, start, done, ctx.detector.events, rid, {
        "seconds_this_session": time.perf_counter() - t0, "world_size": dist.world, "provenance": origin,
        # Equal on every rank under DDP (each rank's own shards under FSDP): a check that ranks agree.
        "param_checksum_by_rank": checksums, **info})
    sink.finish(summary)
    # DDP's reducer holds the process group: free it first, or the group could go with the reducer, whose
    # destructor joins gloo's threads while holding the GIL they need (torch issue #56297: a deadlock).
    ctx.train_model = None
    gc.collect()
    dist.close()
    return summary


@dataclasses.dataclass(frozen=True)
class _Done:
    """Where the steps ended: how many are done, the last step's metrics and the event it stopped on."""

    steps_done: int
    metrics: dict[str, float]
    stopped_on: dict | None


def _steps(ctx: StepContext, start: int, evaluator: Evaluator, checkpointer: Checkpointer,
           sink: MetricSink | NullSink) -> _Done:
    """RL steps `start`.. until trainer.steps or a stop on collapse (`collapse.stop_kinds`), each: the step,
    its evaluation when due, its metrics and new events to the sink, a checkpoint when due."""
    cfg = ctx.cfg
    # Before the first update, in step 0's row. A resumed run (start > 0) kept that row: not repeated.
    initial = evaluator.initial() if start == 0 else {}
    stops = set(cfg.collapse.stop_kinds) if cfg.collapse.stop_on_collapse else set()
    bar = tqdm(range(start, cfg.trainer.steps), initial=start, total=cfg.trainer.steps, desc=run_label(cfg),
               disable=not (cfg.logger.progress and ctx.dist.main), dynamic_ncols=True)
    done = _Done(start, {}, None)
    for step in bar:
        metrics = rl_step(ctx, step)
        if step == start and initial:
            metrics.update(initial)
            ctx.detector.observe_eval(step, initial, prefix="eval/initial/")  # the reference's first point
        last = step + 1 == cfg.trainer.steps
        stopped_on = stop_event(ctx.detector.events, step, stops)
        if evaluator.due(step, last or bool(stopped_on)):
            after = evaluator.run()
            after["time/eval_s"] += metrics.get("time/eval_s", 0.0)  # the initial eval's, in step 0's row
            metrics.update(after)
            ctx.detector.observe_eval(step, after)
            stopped_on = stopped_on or stop_event(ctx.detector.events, step, stops)
        metrics.update(collapse_metrics(ctx.detector.events, step))
        sink.log(step, metrics)
        for event in ctx.detector.events:
            if event.step == step:
                sink.event(dataclasses.asdict(event))
        bar.set_postfix(reward=f"{metrics['rollout/reward/mean']:.3f}", events=len(ctx.detector.events))
        checkpointer.save(step, last or bool(stopped_on), metrics)
        done = _Done(step + 1, metrics, stopped_on)
        if stopped_on:
            break
    bar.close()
    return done


def _summary(cfg: Config, run_dir: Path, dist: Dist, start: int, done: _Done, events: list[CollapseEvent],
             run_id: str, session: dict) -> dict:
    """summary.json: the run's labels, how it ended, the last step's finite metrics (a resumed run with no
    step left reads them from metrics.jsonl), this session's record, and the config (what a resume of the
    finished run checks when its checkpoints are gone: finished_without_checkpoint)."""
    metrics = done.metrics
    if not metrics and dist.main and start > 0:  # nothing left to run: the summary reports the last step
        rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        metrics = {k: from_json_number(v) for k, v in rows[-1].items() if k != "step"} if rows else {}
    return {
        "label": run_label(cfg), "run_id": run_id, "objective": cfg.objective.preset, "replay": cfg.routing.replay,
        "seed": cfg.seed, "experiment": cfg.experiment, "steps_done": done.steps_done,
        "stopped_on_collapse": done.stopped_on,
        "collapse_events": [dataclasses.asdict(e) for e in events],
        "final": {k: v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)},
        **session,
        "config": dataclasses.asdict(cfg),
    }
