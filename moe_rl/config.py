"""Typed configuration: the schema Hydra composes the YAML in `conf/` onto.

The entry point converts the composed config once with `OmegaConf.to_object` into `Config`, then
calls `Config.validate()`, which raises `ValueError` naming the first bad field before any compute.
Each section's dataclass lives beside its package and validates its own fields:

| section | schema |
|---|---|
| model | `moe_rl.models.config.ModelConfig` |
| task | `moe_rl.tasks.config.TaskConfig` |
| objective | `moe_rl.objectives.config.ObjectiveConfig` (and `validate_config`, which reads the objective's row of `moe_rl.objectives.capabilities.CAPABILITIES`) |
| routing | `moe_rl.routing.config.RoutingConfig` |
| sampler, rollout | `moe_rl.rollout.config.SamplerConfig`, `RolloutConfig` |
| trainer, eval, collapse, logger | `moe_rl.trainer.config.TrainerConfig`, `EvalConfig`, `CollapseConfig`, `LoggerConfig` |
| warmstart | `moe_rl.warmstart.config.WarmStartConfig` |

This module composes them into `Config`, whose `validate` adds the checks that read more than one section,
and re-exports every section's names, so `from moe_rl.config import TrainerConfig` keeps working. Neither it
nor any section imports torch (tests/unit/structure/test_config_module.py). The schema does no I/O: the
start-up checks that read files, build the task or look at the machine are in `moe_rl.startup`, above it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from moe_rl.models.config import ModelConfig
from moe_rl.objectives.capabilities import CAPABILITIES
from moe_rl.objectives.config import ObjectiveConfig, validate_config
from moe_rl.rollout.config import RolloutConfig, SamplerConfig
from moe_rl.rollout.engines import ENGINES
from moe_rl.routing.config import NOISE_GROWTH, NOISE_SCOPES, REPLAY, REPLAY_SOURCES, SAMPLER, RoutingConfig
from moe_rl.tasks.config import DATASET, TaskConfig
from moe_rl.trainer.config import (
    COLLAPSE_KINDS,
    ESS_RULES,
    FAILURE_KINDS,
    MAX_ROUTER_LR_SCALE,
    PARALLEL,
    WANDB_MODES,
    CollapseConfig,
    EvalConfig,
    LoggerConfig,
    TrainerConfig,
    check_kinds,
)
from moe_rl.warmstart.config import WarmStartConfig

INFINITE_OK = ("collapse.ratio_max",)
"""Float fields where +inf is meaningful (a threshold that never fires); NaN is refused everywhere."""

__all__ = [
    "COLLAPSE_KINDS", "ESS_RULES", "FAILURE_KINDS", "INFINITE_OK", "MAX_ROUTER_LR_SCALE", "NOISE_GROWTH",
    "NOISE_SCOPES", "PARALLEL", "REPLAY", "REPLAY_SOURCES", "WANDB_MODES", "CollapseConfig", "Config", "EvalConfig",
    "LoggerConfig", "ModelConfig", "ObjectiveConfig", "RolloutConfig", "RoutingConfig", "SamplerConfig", "TaskConfig",
    "TrainerConfig", "WarmStartConfig", "check_finite", "check_kinds",
]


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    """Seed of sampling, shuffling and the task stream (the model's init seed is model.seed)."""
    resume: bool = False
    """Continue from the run folder's last checkpoint (checkpoint.pt, or checkpoint.prev.pt when the
    latest is corrupt). A finished run is left as it is; a folder without a checkpoint starts fresh; a
    config that differs from the checkpoint's outside trainer.steps, trainer.checkpoint_every,
    trainer.threads, rollout.sampler_threads, trainer.dist_timeout_s, warmstart.cache_dir, model.tokenizer_cache_dir and logger.* is
    refused."""
    resume_force: bool = False
    """With resume=true: continue even when the config differs from the checkpoint's (a warning lists
    the changed fields)."""
    overwrite: bool = False
    """Start afresh in a run folder that already holds a run: its files are moved, never deleted, into
    `overwritten-<UTC time>/` inside the folder (moe_rl.trainer.folder). Without it (and without
    resume=true) such a run is refused in one line."""
    experiment: str = "default"
    """Name of the experiment (set by conf/experiment/*.yaml); a W&B grouping field."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field: each section's own checks, then those across sections.
        No file is read and no task is built (`moe_rl.startup.check_config` does both after this)."""
        check_finite(self)
        self.model.validate()
        self.task.validate()
        self._validate_dataset_options()
        validate_config(self.objective)
        t, sp, r = self.trainer, self.sampler, self.routing
        if self.objective.rollout_is != "none" and t.reuse_sampler_logp:
            raise ValueError(
                f"objective.rollout_is={self.objective.rollout_is!r} corrects old vs sampler log-probs, which "
                "trainer.reuse_sampler_logp=true makes identical (weight 1): set objective.rollout_is=none"
            )
        r.validate()
        if r.logit_noise > 0 and r.noise_scope == "trainer" and t.reuse_sampler_logp:
            raise ValueError(
                "routing.noise_scope=trainer perturbs the old-policy forward, which "
                "trainer.reuse_sampler_logp=true skips: set trainer.reuse_sampler_logp=false"
            )
        if r.weight_noise > 0 and t.parallel == "fsdp":
            raise ValueError(
                "routing.weight_noise perturbs whole router weights, which trainer.parallel=fsdp shards: "
                "use trainer.parallel=ddp"
            )
        sp.validate()
        # Not in SamplerConfig.validate: greedy sampling is fine for eval and the warm start, not for RL.
        if sp.temperature == 0:
            raise ValueError(
                "sampler.temperature=0 samples greedily, so every response of a group is the same, every "
                "group-relative advantage is 0 and nothing trains: use a temperature > 0 (held-out eval "
                "reports greedy accuracy on its own: eval/accuracy_greedy)"
            )
        t.validate()
        self._validate_sampler_reuse()
        self._validate_router_dtype()
        self._validate_staleness()
        if CAPABILITIES[self.objective.name].needs_topk and self.sampler.keep_sampling_mask:
            raise ValueError(
                f"sampler.keep_sampling_mask=true renormalises π over the top-p support, and objective="
                f"{self.objective.name}'s top-k divergence reads the policy over the whole vocabulary: set "
                "sampler.keep_sampling_mask=false"
            )
        if self.task.chat_template and self.warmstart.enabled:
            raise ValueError(
                "task.chat_template=true needs warmstart.enabled=false: the warm start trains on plain prompts"
            )
        if self.warmstart.pretrain_steps and not self.warmstart.enabled:
            raise ValueError(
                f"warmstart.pretrain_steps={self.warmstart.pretrain_steps} needs warmstart.enabled=true: "
                "pretraining is the warm start's first stage"
            )
        self.collapse.validate()
        self.logger.validate()
        self.warmstart.validate()
        self.eval.validate()
        if self.seed < 0:
            raise ValueError(f"seed={self.seed}: must be >= 0")
        if self.overwrite and self.resume:
            raise ValueError(
                "overwrite=true moves the folder's run aside, resume=true continues it: set one of them"
            )

    def _validate_sampler_reuse(self) -> None:
        """trainer.reuse_sampler_logp needs log-probs the old policy's forward would compute: those of the
        trained model itself (no dtype copy, no vLLM), not renormalised over a nucleus it does not know."""
        t, sp = self.trainer, self.sampler
        if t.reuse_sampler_logp and t.sampler_dtype not in (None, self.model.dtype):
            raise ValueError(
                f"trainer.reuse_sampler_logp=true needs the sampler to be the trained model, but "
                f"trainer.sampler_dtype={t.sampler_dtype!r} samples with a {t.sampler_dtype} copy: set "
                "trainer.sampler_dtype=null or trainer.reuse_sampler_logp=false"
            )
        if t.reuse_sampler_logp and sp.logprobs == "processed" and sp.top_p < 1 and not sp.keep_sampling_mask:
            raise ValueError(
                f"trainer.reuse_sampler_logp=true with sampler.logprobs=processed at sampler.top_p={sp.top_p}: "
                "processed log-probs are renormalised over the top-p nucleus, so they are not the old policy's "
                "(the first mini-batch's ratio would not be 1); set sampler.logprobs=raw, or "
                "sampler.keep_sampling_mask=true (the trainer's forwards then renormalise over the same nucleus)"
            )
        engine = ENGINES[sp.engine]
        if not engine.gates and self.routing.replay_gates and REPLAY[self.routing.replay].recorded == SAMPLER:
            raise ValueError(
                "routing.replay_gates=true under routing.replay=rollout needs the sampler's gates, and "
                f"sampler.engine={sp.engine} records expert ids only: set routing.replay_gates=false or sampler.engine=hf"
            )
        if not engine.trained_model and t.reuse_sampler_logp:
            raise ValueError(
                "trainer.reuse_sampler_logp=true takes the sampler's log-probs and routes as the old policy's, "
                f"which holds only for the trained model itself, not for sampler.engine={sp.engine}: set "
                "trainer.reuse_sampler_logp=false"
            )

    def _validate_router_dtype(self) -> None:
        """model.router_dtype needs a model below float32 to act on, an hf sampler, and no FSDP2 of a
        low-precision policy (one parameter dtype per sharded layer)."""
        t, sp = self.trainer, self.sampler
        if self.model.router_dtype is not None:
            low = [d for d in (self.model.dtype, t.sampler_dtype) if d in ("bfloat16", "float16")]
            if not low:
                raise ValueError(
                    f"model.router_dtype={self.model.router_dtype} has no effect: model.dtype={self.model.dtype} "
                    f"and trainer.sampler_dtype={t.sampler_dtype} hold no model below float32; set "
                    "model.router_dtype=null, or model.dtype / trainer.sampler_dtype to bfloat16"
                )
            if not ENGINES[sp.engine].router_dtype:
                raise ValueError(
                    f"model.router_dtype with sampler.engine={sp.engine}: the engine sets its own router dtype; set "
                    "model.router_dtype=null or sampler.engine=hf"
                )
            if t.parallel == "fsdp" and self.model.dtype in ("bfloat16", "float16"):
                raise ValueError(
                    "model.router_dtype=float32 with trainer.parallel=fsdp: FSDP2 shards one parameter dtype "
                    f"per layer and model.dtype={self.model.dtype}; set model.router_dtype=null or "
                    "trainer.parallel=ddp"
                )

    def _validate_staleness(self) -> None:
        """rollout.staleness against the run's length and the sampler (RolloutConfig)."""
        ro, t = self.rollout, self.trainer
        ro.validate()
        if ro.staleness and ro.staleness >= t.steps:
            raise ValueError(
                f"rollout.staleness={ro.staleness} must be below trainer.steps={t.steps}: no step would train on "
                "a rollout of a policy it has trained"
            )
        if ro.staleness and t.reuse_sampler_logp:
            raise ValueError(
                f"rollout.staleness={ro.staleness} with trainer.reuse_sampler_logp=true: the stale sampler's "
                "log-probs are not the proximal policy's (this step's old-policy forward); set "
                "trainer.reuse_sampler_logp=false"
            )
        if ro.overlap and not ENGINES[self.sampler.engine].overlap:
            raise ValueError(
                f"rollout.overlap=true is not available with sampler.engine={self.sampler.engine} (its in-process engine cannot "
                "sample on a thread beside the trainer): set rollout.overlap=false (deterministic staleness)"
            )

    def _validate_dataset_options(self) -> None:
        """The options that depend on the task or the model's origin (model.tokenizer, pretraining). Not in
        ModelConfig.validate: a warm-started model is loaded as pretrained with the run's tokenizer fields."""
        dataset = self.task.name == DATASET
        if self.model.pretrained and self.model.tokenizer != "char":
            raise ValueError(
                f"model.tokenizer={self.model.tokenizer}: model.pretrained={self.model.pretrained} brings its "
                "own tokenizer; model.tokenizer is for models built from config (leave it char)"
            )
        if self.model.tokenizer == "bpe" and not dataset:
            raise ValueError(
                "model.tokenizer=bpe trains on a dataset's text, so it needs task=dataset (the synthetic "
                "tasks' alphabet is a char vocabulary)"
            )
        if dataset and self.warmstart.enabled and self.warmstart.pretrain_steps:
            raise ValueError(
                f"warmstart.pretrain_steps={self.warmstart.pretrain_steps} pretrains on the synthetic tasks, "
                "whose text a dataset's tokenizer does not cover: set warmstart.pretrain_steps=0 for task=dataset"
            )


def check_finite(config: Any, prefix: str = "") -> None:
    """Raise ValueError naming the first float field (at any depth, list items included) that is NaN or
    infinite; comparisons with NaN are always false, so range checks alone would let it through."""
    for f in fields(config):
        value, name = getattr(config, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            check_finite(value, name + ".")
            continue
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, float) and not math.isfinite(v) and not (v == math.inf and name in INFINITE_OK):
                raise ValueError(f"{name}={value}: must be a finite number")
