"""What a run starts from and what it leaves: the resume decision, then checkpoints and the exported policy.

    plan_resume(cfg, run_dir, dist)      -> Resume: a checkpoint to continue from, a finished run, or step 0
    record_start(run_dir, dist, resume)  -> the run's id (rank 0 records it, and Hydra's record)
    Checkpointer(run_dir, ctx, resume, run_id)
      .load()                            -> the first step to run (the checkpoint restored into the context)
      .save(step, last, metrics)         -> checkpoint.pt after a step when due, and policy/ (export.py)

The files themselves (format, rotation, fallback, the config check of a resume) are checkpoint.py's;
the run folder's lock and id are folder.py's. Every rank calls `save` (under FSDP gathering the full
state is a collective); rank 0 writes.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

from moe_rl.config import Config
from moe_rl.errors import RunError
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
from moe_rl.trainer.distributed import Dist, load_state_dicts, state_dicts
from moe_rl.trainer.export import export_policy
from moe_rl.trainer.folder import RUN_ID, folder_run_id, move_aside, record_run_id, run_files
from moe_rl.trainer.step import StepContext


@dataclasses.dataclass(frozen=True)
class Resume:
    """What a run in a claimed folder starts from."""

    state: dict | None
    """The checkpoint to continue from; None: step 0."""
    finished: dict | None
    """The summary of a run that has already ended (all its steps done, or stopped on collapse): nothing to run."""
    run_id: str | None
    """The folder's run id, kept by the run (None: the run takes the checkpoint's, or a new one)."""


def plan_resume(cfg: Config, run_dir: Path, dist: Dist) -> Resume:
    """Whether a run resumes, and from what; before any compute or write, so a refused resume or an
    unusable checkpoint stops here in one line. Without resume=true: step 0. With it: the folder's
    checkpoint; a run that already finished (with or without its checkpoints) is left as it is; an
    unfinished run without a checkpoint is moved aside and the run starts fresh, with a warning."""
    known_id = folder_run_id(run_dir)
    if not cfg.resume:
        return Resume(None, None, known_id)
    config, defaults = dataclasses.asdict(cfg), dataclasses.asdict(Config())
    state = resume_state(run_dir, config, force=cfg.resume_force, defaults=defaults, run_id=known_id)
    if state is not None:
        done = finished_summary(run_dir, state, cfg.trainer.steps)
        if done is not None:
            restore_hydra_files(run_dir, state.get("hydra", {}))
            warnings.warn(f"{run_dir} already finished at step {state['step']}: nothing to resume", RuntimeWarning,
                          stacklevel=4)
        return Resume(state, done, known_id)
    done = finished_without_checkpoint(run_dir, config, cfg.trainer.steps, force=cfg.resume_force, defaults=defaults,
                                       run_id=known_id)
    if done is not None:
        warnings.warn(f"{run_dir} already finished at step {done['steps_done']} (its checkpoints are gone): "
                      "nothing to resume", RuntimeWarning, stacklevel=4)
        return Resume(None, done, known_id)
    aside = move_aside(run_dir) if dist.main and set(run_files(run_dir)) - {RUN_ID} else None  # unfinished
    moved = f": its earlier files are now in {aside}" if aside else ""
    warnings.warn(f"resume=true, but {run_dir} has no checkpoint{moved}; starting fresh", RuntimeWarning, stacklevel=4)
    return Resume(None, None, dist.broadcast(folder_run_id(run_dir) if dist.main else None))


def record_start(run_dir: Path, dist: Dist, resume: Resume, hydra_record: dict[str, str]) -> str:
    """The run's id, on every rank. Rank 0 removes an earlier attempt's failed.json, records the id (the
    folder's, else the checkpoint's, else a new one) and writes Hydra's record of this run."""
    rid = None
    if dist.main:
        (run_dir / "failed.json").unlink(missing_ok=True)  # from an earlier attempt at this job
        rid = record_run_id(run_dir, resume.run_id or (resume.state or {}).get("run_id"))
        restore_hydra_files(run_dir, hydra_record)
    return dist.broadcast(rid)


class Checkpointer:
    """A run's checkpoints (every `trainer.checkpoint_every` steps and at its end) and its policy/ export
    (at its end, and with every checkpoint under `trainer.export_hf`)."""

    def __init__(self, run_dir: Path, ctx: StepContext, resume: Resume, run_id: str) -> None:
        self.run_dir, self.ctx, self.run_id = run_dir, ctx, run_id
        self.resume_from = resume.state
        self.hydra = resume.state.get("hydra", {}) if resume.state else hydra_files(run_dir)
        self.config = dataclasses.asdict(ctx.cfg)

    def load(self) -> int:
        """Restore the checkpoint the run resumes from into the context; the first step to run (0: none)."""
        return restore(self.ctx, self.resume_from) if self.resume_from else 0

    def save(self, step: int, last: bool, metrics: dict[str, float]) -> None:
        """After RL step `step` (0-based; `metrics` its metrics): a checkpoint when the run ends with it
        (`last`: its last step, or a stop on collapse) or every `trainer.checkpoint_every` steps, and the
        policy's export with the last one (with every one under `trainer.export_hf`)."""
        t, dist = self.ctx.cfg.trainer, self.ctx.dist
        if not (last or (t.checkpoint_every and (step + 1) % t.checkpoint_every == 0)):
            return
        state = self.state(step + 1)
        if dist.main:
            write(self.run_dir, state)
        if dist.main and (last or t.export_hf):
            export_policy(self.run_dir, self.ctx.model, self.ctx.tokenizer, config=self.config, step=step + 1,
                          metrics=metrics, state_dict=state["model"] if self.ctx.sharded else None)

    def state(self, next_step: int) -> dict:
        """Everything to resume from; under FSDP a collective (the full state dicts are gathered to rank 0)."""
        ctx = self.ctx
        model_sd, optimizer_sd = state_dicts(ctx.model, ctx.optimizer, ctx.sharded)
        return {
            "step": next_step,
            "run_id": self.run_id,  # a resume loads only its own run's checkpoints (moe_rl.trainer.folder)
            "config": self.config,  # resume refuses a different config (checkpoint.py)
            "hydra": self.hydra,
            "model": model_sd,
            "optimizer": optimizer_sd,
            "scheduler": ctx.scheduler.state_dict(),
            "detector": ctx.detector.state_dict(),
            "rng": rng_state({"sample": ctx.sample_gen, "shuffle": ctx.shuffle_gen}),
            "sampler": ctx.sampler.state_dict(),  # rollouts sampled ahead (rollout.staleness)
        }


def restore(ctx: StepContext, state: dict) -> int:
    """Load a checkpoint's `state` into `ctx` (the policy, optimiser, scheduler, detector, RNGs and the
    sampler's weights and rollouts); the step to continue from."""
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
            RuntimeWarning, stacklevel=4,
        )
    return state["step"]


def write(run_dir: Path, state: dict) -> None:
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
