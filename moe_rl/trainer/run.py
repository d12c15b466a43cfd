"""A whole run: build (or warm-start) the policy, loop over RL steps, log, checkpoint, resume."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from moe_rl.config import Config
from moe_rl.models import build_model, build_tokenizer
from moe_rl.routing import RoutingController
from moe_rl.tasks import make_task
from moe_rl.trainer.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from moe_rl.trainer.collapse import CollapseDetector
from moe_rl.trainer.logging import LocalLog, NullWandb, open_wandb
from moe_rl.trainer.step import StepContext, rl_step
from moe_rl.warmstart import warm_start


def run_label(cfg: Config) -> str:
    """How a run is named in tables and W&B: objective preset and replay source, from the config."""
    return f"{cfg.objective.preset} (replay={cfg.routing.replay})"


def _policy(cfg: Config):
    """The initial policy: warm-started (cached) when enabled, else freshly built."""
    if not cfg.warmstart.enabled:
        tokenizer = (
            AutoTokenizer.from_pretrained(cfg.model.pretrained) if cfg.model.pretrained else build_tokenizer()
        )
        return build_model(cfg.model, tokenizer), tokenizer, None
    ws = warm_start(
        cfg.model,
        cfg.task.name,
        cfg.task.difficulty,
        cfg.warmstart,
        cfg.seed,
        max_new_tokens=cfg.sampler.max_new_tokens,
        progress=cfg.logger.progress,
        device=cfg.trainer.device,
    )
    model = build_model(dataclasses.replace(cfg.model, pretrained=str(ws.path)))
    return model, AutoTokenizer.from_pretrained(ws.path), ws


def _context(cfg: Config) -> tuple[StepContext, dict]:
    torch.manual_seed(cfg.seed)
    model, tokenizer, ws = _policy(cfg)
    device = torch.device(cfg.trainer.device)
    model.to(device)
    t = cfg.trainer
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, t.warmup_steps))
    )
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.objective.beta > 0 else None
    sampler = None
    if t.sampler_dtype is not None and t.sampler_dtype != cfg.model.dtype:
        sampler = copy.deepcopy(model).to(getattr(torch, t.sampler_dtype)).eval().requires_grad_(False)
    ctx = StepContext(
        cfg,
        model,
        tokenizer,
        RoutingController(model),
        make_task(cfg.task.name, cfg.task.difficulty),
        optimizer,
        scheduler,
        torch.Generator(device).manual_seed(cfg.seed),
        torch.Generator().manual_seed(cfg.seed + 1),
        CollapseDetector(cfg.collapse),
        ref,
        sampler,
        RoutingController(sampler) if sampler is not None else None,
    )
    info = {"warmstart_accuracy": ws.accuracy if ws else None, "warmstart_path": str(ws.path) if ws else None}
    return ctx, info


def _state(ctx: StepContext, next_step: int) -> dict:
    return {
        "step": next_step,
        "model": ctx.model.state_dict(),
        "optimizer": ctx.optimizer.state_dict(),
        "scheduler": ctx.scheduler.state_dict(),
        "detector": ctx.detector.state_dict(),
        "rng": rng_state({"sample": ctx.sample_gen, "shuffle": ctx.shuffle_gen}),
    }


def _restore(ctx: StepContext, state: dict) -> int:
    ctx.model.load_state_dict(state["model"])
    ctx.optimizer.load_state_dict(state["optimizer"])
    ctx.scheduler.load_state_dict(state["scheduler"])
    ctx.detector.load_state_dict(state["detector"])
    set_rng_state(state["rng"], {"sample": ctx.sample_gen, "shuffle": ctx.shuffle_gen})
    ctx.sync_sampler()
    return state["step"]


def train(cfg: Config, run_dir: Path, *, wandb_group: str | None = None) -> dict:
    """Run RL as configured, writing metrics.jsonl, events.jsonl, summary.json and checkpoints to run_dir."""
    cfg.validate()
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    ctx, info = _context(cfg)
    state = load_checkpoint(run_dir) if cfg.resume else None
    start = _restore(ctx, state) if state else 0
    local = LocalLog(run_dir, resume_step=start if state else None)
    config_dict = dataclasses.asdict(cfg)
    lg = cfg.logger
    wb = NullWandb()
    if lg.wandb and lg.mode != "disabled":
        tags = [cfg.objective.preset, f"replay={cfg.routing.replay}", cfg.experiment, *lg.tags]
        wb = open_wandb(
            run_dir,
            config_dict,
            mode=lg.mode,
            project=lg.project,
            entity=lg.entity,
            group=lg.group or wandb_group or cfg.experiment,
            name=f"{run_label(cfg)} seed={cfg.seed}",
            tags=tags,
        )
    stopped_on = None
    t0 = time.perf_counter()
    bar = tqdm(
        range(start, cfg.trainer.steps),
        initial=start,
        total=cfg.trainer.steps,
        desc=run_label(cfg),
        disable=not lg.progress,
        dynamic_ncols=True,
    )
    metrics: dict[str, float] = {}
    for step in bar:
        metrics = rl_step(ctx, step)
        local.log(step, metrics)
        wb.log(metrics, step=step)
        new = [e for e in ctx.detector.events if e.step == step]
        for event in new:
            local.event(dataclasses.asdict(event))
        bar.set_postfix(reward=f"{metrics['rollout/reward/mean']:.3f}", events=len(ctx.detector.events))
        last = step + 1 == cfg.trainer.steps
        if new and cfg.collapse.stop_on_collapse:
            stopped_on = dataclasses.asdict(new[0])
        if (
            last
            or stopped_on
            or (cfg.trainer.checkpoint_every and (step + 1) % cfg.trainer.checkpoint_every == 0)
        ):
            save_checkpoint(run_dir, _state(ctx, step + 1))
        if stopped_on:
            break
    bar.close()
    summary = {
        "label": run_label(cfg),
        "objective": cfg.objective.preset,
        "replay": cfg.routing.replay,
        "seed": cfg.seed,
        "experiment": cfg.experiment,
        "steps_done": len(_read_steps(run_dir)),
        "stopped_on_collapse": stopped_on,
        "collapse_events": [dataclasses.asdict(e) for e in ctx.detector.events],
        "final": {k: v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)},
        "seconds_this_session": time.perf_counter() - t0,
        **info,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    wb.summary({"stopped_on_collapse": bool(stopped_on), "collapse/total": len(ctx.detector.events)})
    wb.finish()
    return summary


def _read_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return (
        [json.loads(line)["step"] for line in path.read_text().splitlines() if line] if path.exists() else []
    )
