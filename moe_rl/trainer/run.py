"""A whole run: build (or warm-start) the policy, loop over RL steps, log, checkpoint, resume.

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
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from moe_rl.config import Config
from moe_rl.errors import RunError
from moe_rl.models import build_model
from moe_rl.models.build import unloadable
from moe_rl.models.tokenizer import policy_tokenizer
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
from moe_rl.tasks import DatasetTask, Task
from moe_rl.trainer.checkpoint import (
    CHECKPOINT,
    finished_summary,
    finished_without_checkpoint,
    hydra_files,
    restore_hydra_files,
    resume_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from moe_rl.trainer.collapse import CollapseDetector, CollapseEvent, blowup_counts, counts_by_kind
from moe_rl.trainer.distributed import (
    Dist,
    init_distributed,
    load_state_dicts,
    param_checksum,
    shard,
    state_dicts,
    wrap,
)
from moe_rl.trainer.evaluate import evaluate, initial_metrics
from moe_rl.trainer.export import export_policy
from moe_rl.trainer.folder import (
    RUN_ID,
    check_fresh_start,
    folder_lock,
    folder_run_id,
    move_aside,
    record_run_id,
    run_files,
)
from moe_rl.trainer.logging import (
    CollapseAlerts,
    LocalLog,
    NullSink,
    from_json_number,
    open_wandb,
    read_jsonl,
    to_json,
)
from moe_rl.trainer.precision import make_optimizer, router_param_groups
from moe_rl.trainer.samplers import Draws, chat_prompt
from moe_rl.trainer.sampling import build_sampler
from moe_rl.trainer.stale import thread_split
from moe_rl.trainer.step import StepContext, rl_step
from moe_rl.warmstart import warm_start


def run_label(cfg: Config) -> str:
    """How a run is named in tables and W&B: objective preset and replay source, from the config."""
    return f"{cfg.objective.preset} (replay={cfg.routing.replay})"


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """A saved tokenizer, set up for batched sampling: left padding, and EOS as the pad token when it has
    none (Mixtral's): the sampler masks everything after a response's first EOS."""
    with unloadable(path, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def initial_policy(cfg: Config, progress: bool, task: Task | None = None):
    """The initial policy for `task` (default `moe_rl.startup.load_task(cfg)`): warm-started (cached) when
    enabled, else freshly built or loaded."""
    task = task if task is not None else load_task(cfg)
    if not cfg.warmstart.enabled:
        tokenizer = load_tokenizer(cfg.model.pretrained) if cfg.model.pretrained else policy_tokenizer(cfg.model, task)
        return build_model(cfg.model, tokenizer), tokenizer, None
    ws = warm_start(
        cfg.model,
        cfg.task.name,
        cfg.task.difficulty,
        cfg.warmstart,
        cfg.seed if cfg.warmstart.build_seed is None else cfg.warmstart.build_seed,
        mix=cfg.task.mix,
        max_new_tokens=cfg.sampler.max_new_tokens,
        progress=progress,
        device=cfg.trainer.device,
        task=task,
    )
    # A cache entry that verifies but does not load (a planted file with matching checksums) is named as
    # the cache entry, not as model.pretrained, which the user never set.
    where = f"the warm-start cache entry {ws.path} (delete it to rebuild it)"
    model = build_model(dataclasses.replace(cfg.model, pretrained=str(ws.path)), where=where)
    with unloadable(str(ws.path), "tokenizer", where):
        tokenizer = AutoTokenizer.from_pretrained(ws.path)
    return model, tokenizer, ws


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


def _first_of(events: list[CollapseEvent], step: int, kinds: set[str]) -> dict | None:
    """The first of `step`'s events whose kind is in `kinds` (the ones the run stops on), as a dict."""
    return next((dataclasses.asdict(e) for e in events if e.step == step and e.kind in kinds), None)


def _state(ctx: StepContext, next_step: int, hydra: dict[str, str], run_id: str) -> dict:
    """Everything to resume from; under FSDP a collective (the full state dicts are gathered to rank 0)."""
    model_sd, optimizer_sd = state_dicts(ctx.model, ctx.optimizer, ctx.sharded)
    return {
        "step": next_step,
        "run_id": run_id,  # a resume loads only its own run's checkpoints (moe_rl.trainer.folder)
        "config": dataclasses.asdict(ctx.cfg),  # resume refuses a different config (checkpoint.py)
        "hydra": hydra,
        "model": model_sd,
        "optimizer": optimizer_sd,
        "scheduler": ctx.scheduler.state_dict(),
        "detector": ctx.detector.state_dict(),
        "rng": rng_state({"sample": ctx.sample_gen, "shuffle": ctx.shuffle_gen}),
        "sampler": ctx.sampler.state_dict(),  # rollouts sampled ahead (rollout.staleness)
    }


def _restore(ctx: StepContext, state: dict) -> int:
    cfg = ctx.cfg
    load_state_dicts(ctx.model, ctx.optimizer, state["model"], state["optimizer"], ctx.sharded)
    ctx.scheduler.load_state_dict(state["scheduler"])
    ctx.detector.load_state_dict(state["detector"])
    set_rng_state(state["rng"], {"sample": ctx.sample_gen, "shuffle": ctx.shuffle_gen})
    ctx.sampler.sync(ctx.model)
    ctx.sampler.load_state_dict(state.get("sampler", {}))
    if cfg.rollout.overlap:
        k = cfg.rollout.staleness
        warnings.warn(
            f"rollout.overlap=true: the rollouts in flight when the run stopped were lost with it; steps "
            f"{state['step']}-{state['step'] + k} are sampled again with the restored policy (version {state['step']})",
            RuntimeWarning, stacklevel=3,
        )
    return state["step"]


def _save(run_dir: Path, state: dict) -> None:
    """save_checkpoint, with a full or unwritable disk reported in one line (saying whether an earlier
    checkpoint is there to resume from)."""
    had_one = (run_dir / CHECKPOINT).exists()
    try:
        save_checkpoint(run_dir, state)
    except OSError as err:
        then = (
            "the previous checkpoint is intact: free space and resume with resume=true"
            if had_one
            else "it was the run's first, so there is none to resume from: free space and run again with overwrite=true"
        )
        raise RunError(f"could not write a checkpoint to {run_dir} ({err.strerror or err}); {then}") from err


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
    with _claim(run_dir, cfg, dist):
        return _train(cfg, run_dir, dist, wandb_group, hydra_record or {}, task)


@contextlib.contextmanager
def _claim(run_dir: Path, cfg: Config, dist: Dist) -> Iterator[None]:
    """Rank 0 holds the folder's lock for the body, after refusing a fresh run over an old one (or moving
    it aside under overwrite=true); every rank raises rank 0's refusal, so none waits on a collective."""
    with contextlib.ExitStack() as held:
        refusal, aside = None, None
        if dist.main:
            try:
                held.enter_context(folder_lock(run_dir))
                aside = check_fresh_start(run_dir, resume=cfg.resume, overwrite=cfg.overwrite)
            except RunError as err:
                refusal = err
        message = dist.broadcast(str(refusal) if refusal else None)
        if refusal is not None:
            raise refusal
        if message is not None:
            raise RunError(message)
        if aside is not None:
            warnings.warn(f"overwrite=true: the earlier run's files are now in {aside}", RuntimeWarning, stacklevel=3)
        yield


def _train(cfg: Config, run_dir: Path, dist: Dist, wandb_group: str | None, hydra_record: dict[str, str],
           task: Task | None = None) -> dict:
    """`train` in a claimed folder."""
    # Before any compute or write: a refused resume or an unusable checkpoint stops here in one line.
    known_id = folder_run_id(run_dir)
    state = (
        resume_state(
            run_dir,
            dataclasses.asdict(cfg),
            force=cfg.resume_force,
            defaults=dataclasses.asdict(Config()),
            run_id=known_id,
        )
        if cfg.resume
        else None
    )
    done = finished_summary(run_dir, state, cfg.trainer.steps) if state else None
    if done is not None:
        restore_hydra_files(run_dir, state.get("hydra", {}))
        warnings.warn(f"{run_dir} already finished at step {state['step']}: nothing to resume", RuntimeWarning, stacklevel=3)
        dist.close()
        return done
    if cfg.resume and state is None:
        done = finished_without_checkpoint(run_dir, dataclasses.asdict(cfg), cfg.trainer.steps,
                                           force=cfg.resume_force, defaults=dataclasses.asdict(Config()), run_id=known_id)
        if done is not None:
            warnings.warn(f"{run_dir} already finished at step {done['steps_done']} (its checkpoints are gone): "
                          "nothing to resume", RuntimeWarning, stacklevel=3)
            dist.close()
            return done
        aside = move_aside(run_dir) if dist.main and set(run_files(run_dir)) - {RUN_ID} else None  # unfinished
        moved = f": its earlier files are now in {aside}" if aside else ""
        warnings.warn(f"resume=true, but {run_dir} has no checkpoint{moved}; starting fresh", RuntimeWarning, stacklevel=3)
        known_id = dist.broadcast(folder_run_id(run_dir) if dist.main else None)
    rid = None
    if dist.main:
        (run_dir / "failed.json").unlink(missing_ok=True)  # from an earlier attempt at this job
        rid = record_run_id(run_dir, known_id or (state or {}).get("run_id"))
        restore_hydra_files(run_dir, hydra_record)
    rid = dist.broadcast(rid)
    hydra = state.get("hydra", {}) if state else hydra_files(run_dir)
    threads = thread_split(cfg.trainer.threads, cfg.rollout.sampler_threads)[0] if cfg.rollout.overlap else cfg.trainer.threads
    if threads:
        torch.set_num_threads(threads)
    origin = provenance(cfg.trainer.device)  # after the thread count is set: it is part of the record
    ctx, info = build_context(cfg, dist, task)
    start = _restore(ctx, state) if state else 0
    local = LocalLog(run_dir, resume_step=start if state else None) if dist.main else NullSink()
    config_dict = dataclasses.asdict(cfg)
    lg = cfg.logger
    wb = NullSink()
    if dist.main and lg.wandb and lg.mode != "disabled":
        tags = [cfg.objective.preset, f"replay={cfg.routing.replay}", cfg.experiment, *lg.tags]
        wb = open_wandb(
            run_dir,
            {**config_dict, "provenance": origin},
            mode=lg.mode,
            project=lg.project,
            entity=lg.entity,
            group=lg.group or wandb_group or cfg.experiment,
            name=f"{run_label(cfg)} seed={cfg.seed}",
            tags=tags,
            init_timeout_s=lg.init_timeout_s,
        )
    alerts = CollapseAlerts(wb if lg.alerts else NullSink(), lg.alert_interval_s, lg.alert_kinds)
    alerts.tag_past([dataclasses.asdict(e) for e in ctx.detector.events])
    stopped_on = None
    t0 = time.perf_counter()
    bar = tqdm(
        range(start, cfg.trainer.steps),
        initial=start,
        total=cfg.trainer.steps,
        desc=run_label(cfg),
        disable=not (lg.progress and dist.main),
        dynamic_ncols=True,
    )
    metrics: dict[str, float] = {}
    steps_done = start
    # A dataset with fewer held-out rows than eval asks for is evaluated on all of them (eval.fit_heldout).
    eval_cfg = cfg.eval.fitted(len(ctx.task.heldout_rows)) if isinstance(ctx.task, DatasetTask) else cfg.eval
    eval_examples = ctx.task.examples("eval", eval_cfg.prompts_needed, eval_cfg.seed)
    eval_prompts = [ctx.prompt(ex.prompt) for ex in eval_examples]
    evaluation = functools.partial(
        evaluate, ctx.model, ctx.tokenizer, ctx.task, eval_prompts, eval_examples, cfg.sampler, eval_cfg
    )
    # Before the first update, in step 0's row. A resumed run (start > 0) kept that row: not repeated.
    initial = initial_metrics(evaluation()) if start == 0 and cfg.eval.enabled and cfg.eval.at_start else {}
    stops = set(cfg.collapse.stop_kinds) if cfg.collapse.stop_on_collapse else set()
    with contextlib.closing(ctx.sampler):  # stops a background sampler (rollout.overlap) however the loop ends
        for step in bar:
            metrics = rl_step(ctx, step)
            if step == start and initial:
                metrics.update(initial)
                ctx.detector.observe_eval(step, initial, prefix="eval/initial/")  # the reference's first point
            steps_done = step + 1
            last = step + 1 == cfg.trainer.steps
            stopped_on = _first_of(ctx.detector.events, step, stops)
            if cfg.eval.due(step, last or bool(stopped_on)):
                after = evaluation()
                after["time/eval_s"] += metrics.get("time/eval_s", 0.0)  # the initial eval's, in step 0's row
                metrics.update(after)
                ctx.detector.observe_eval(step, after)
                stopped_on = stopped_on or _first_of(ctx.detector.events, step, stops)
            new = [e for e in ctx.detector.events if e.step == step]
            metrics["collapse/events"] = float(len(ctx.detector.events))
            metrics["collapse/new_events"] = float(len(new))
            metrics.update(counts_by_kind(ctx.detector.events))
            metrics.update(blowup_counts(ctx.detector.events))
            local.log(step, metrics)
            wb.log(metrics, step=step)
            for event in new:
                local.event(dataclasses.asdict(event))
                alerts(dataclasses.asdict(event))
            bar.set_postfix(reward=f"{metrics['rollout/reward/mean']:.3f}", events=len(ctx.detector.events))
            if (
                last
                or stopped_on
                or (cfg.trainer.checkpoint_every and (step + 1) % cfg.trainer.checkpoint_every == 0)
            ):
                state = _state(ctx, step + 1, hydra, rid)
                if dist.main:
                    _save(run_dir, state)
                if dist.main and (last or stopped_on or cfg.trainer.export_hf):
                    export_policy(
                        run_dir,
                        ctx.model,
                        ctx.tokenizer,
                        config=config_dict,
                        step=step + 1,
                        metrics=metrics,
                        state_dict=state["model"] if ctx.sharded else None,
                    )
            if stopped_on:
                break
        # The last collective, before the sampler closes: a vLLM engine leaves the process group as it shuts down.
        checksums = dist.gather(param_checksum(ctx.model))
    bar.close()
    if not metrics and dist.main and start > 0:  # nothing left to run: the summary reports the last step
        rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        metrics = {k: from_json_number(v) for k, v in rows[-1].items() if k != "step"} if rows else {}
    summary = {
        "label": run_label(cfg),
        "run_id": rid,
        "objective": cfg.objective.preset,
        "replay": cfg.routing.replay,
        "seed": cfg.seed,
        "experiment": cfg.experiment,
        "steps_done": steps_done,
        "stopped_on_collapse": stopped_on,
        "collapse_events": [dataclasses.asdict(e) for e in ctx.detector.events],
        "final": {k: v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)},
        "seconds_this_session": time.perf_counter() - t0,
        "world_size": dist.world,
        "provenance": origin,
        # Equal on every rank under DDP (each rank's own shards under FSDP): a check that ranks agree.
        "param_checksum_by_rank": checksums,
        **info,
        # What a resume of this finished run checks when its checkpoints are gone (finished_without_checkpoint).
        "config": config_dict,
    }
    if dist.main:
        tmp = run_dir / ".summary.json.tmp"
        tmp.write_text(to_json(summary, indent=2))
        tmp.replace(run_dir / "summary.json")
    wb.summary({"stopped_on_collapse": bool(stopped_on), "collapse/total": len(ctx.detector.events)})
    wb.finish()
    # DDP's reducer holds the process group: free it first, or the group could go with the reducer, whose
    # destructor joins gloo's threads while holding the GIL they need (torch issue #56297: a deadlock).
    ctx.train_model = None
    gc.collect()
    dist.close()
    return summary
