"""Typed configuration: the schema Hydra composes the YAML in `conf/` onto.

The entry point converts the composed config once with `OmegaConf.to_object` into `Config`, then
calls `Config.validate()`, which raises `ValueError` naming the first bad field before any compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import torch

from moe_rl.models.config import DTYPES, ModelConfig
from moe_rl.objectives import OBJECTIVES
from moe_rl.objectives.common import AGGREGATIONS
from moe_rl.rollout.sampler import SamplerConfig
from moe_rl.tasks import TASKS, make_task
from moe_rl.warmstart import WarmStartConfig

INFINITE_OK = ("collapse.ratio_max",)
"""Float fields where +inf is meaningful (a threshold that never fires); NaN is refused everywhere."""

REPLAY_SOURCES = ("off", "old", "rollout")
PARALLEL = ("ddp", "fsdp")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class TaskConfig:
    """Which verifiable task to train on."""

    name: str = "arithmetic"
    """One of moe_rl.tasks.TASKS: arithmetic, sort, countdown."""
    difficulty: int = 1
    """The task's knob: operand digits (arithmetic), items (sort), numbers (countdown)."""
    chat_template: bool = False
    """Wrap each prompt as one user turn in the tokenizer's chat template (pretrained chat models); the
    run stops with an error if the tokenizer has none. Needs warmstart.enabled=false."""


@dataclass
class ObjectiveConfig:
    """The policy objective and its clip range (GSPO paper's settings in conf/objective/)."""

    name: str = "gspo"
    """Registry key in moe_rl.objectives.OBJECTIVES: grpo, gspo, gspo_token."""
    preset: str = "gspo"
    """Label of the preset (grpo, grpo_rr, grpo_r3, gspo, gspo_token) used in tables and W&B."""
    clip_low: float = 3e-4
    """Lower clip: ratios below 1 - clip_low are clipped for negative advantages."""
    clip_high: float = 4e-4
    """Upper clip: ratios above 1 + clip_high are clipped for positive advantages."""
    loss_agg: str = "seq-mean-token-mean"
    """Aggregation (grpo only): seq-mean-token-mean, token-mean, seq-mean-token-sum-norm."""
    beta: float = 0.0
    """k3 KL penalty to the initial (reference) policy; 0 as in the paper."""
    normalize_std: bool = True
    """Divide group advantages by the group std (False = Dr. GRPO)."""
    extreme_band: list[float] = field(default_factory=lambda: [0.5, 2.0])
    """Token ratios outside [lo, hi] count in ratio/token/extreme_frac."""


@dataclass
class RoutingConfig:
    """Routing replay: which recorded routing the update forwards use."""

    replay: str = "off"
    """off: routers choose freely; old: the old-policy forward's routing (Routing Replay, R2);
    rollout: the sampler's routing (rollout routing replay, R3)."""


@dataclass
class TrainerConfig:
    """The RL loop."""

    steps: int = 40
    """RL steps (each: sample, score, old-policy forward, `mini_batches` optimizer steps)."""
    prompts_per_step: int = 16
    """P: distinct prompts per step."""
    group_size: int = 8
    """G: completions per prompt; advantages are relative within a group."""
    mini_batches: int = 4
    """M: optimizer steps per RL step; only the first is on-policy (paper: 4)."""
    lr: float = 1e-4
    """AdamW peak learning rate."""
    warmup_steps: int = 2
    """Linear learning-rate warmup, in optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value."""
    checkpoint_every: int = 10
    """Save a checkpoint every N RL steps (and at the end); 0 = only at the end."""
    threads: int = 0
    """torch CPU threads; 0 leaves torch's default."""
    device: str = "cpu"
    """Device of the model: cpu or cuda."""
    sampler_dtype: str | None = None
    """Sample with a separate copy of the policy in this dtype (e.g. bfloat16, as a low-precision
    inference engine would), synced after every step; None samples with the trained model itself."""
    parallel: str = "ddp"
    """Under torchrun with several processes: ddp (each rank holds the whole model; gradients are
    all-reduced) or fsdp (FSDP2: parameters, gradients and optimizer state sharded over ranks)."""
    dist_timeout_s: int = 300
    """Seconds a collective waits for the other ranks before the job fails (a dead or hung rank)."""
    reuse_sampler_logp: bool = False
    """Skip the old-policy forward: use the sampler's log-probs and routing as the old policy's (GSPO
    paper, section 5.4). The same weights at the same precision compute them, so they agree with a full
    forward to float rounding (~1e-6), and the first mini-batch's ratios are 1 to that precision
    instead of exactly. Needs the sampler to be the trained model (trainer.sampler_dtype null)."""


@dataclass
class CollapseConfig:
    """Collapse-event detection thresholds."""

    warmup_steps: int = 5
    """Steps before reward and entropy collapse can fire."""
    reward_window: int = 5
    """Moving-average window of the mean reward."""
    reward_frac: float = 0.5
    """Reward collapse: moving average below this fraction of its best value so far."""
    entropy_min: float = 0.02
    """Entropy collapse: mean sampler token entropy (nats) below this."""
    ratio_max: float = 1e3
    """Ratio blow-up: a token ratio above ratio_max or below 1 / ratio_max."""
    stop_on_collapse: bool = False
    """Stop the run at the first collapse event; the summary says so."""


@dataclass
class LoggerConfig:
    """Where metrics go: always metrics.jsonl and summary.json in the run folder, plus W&B."""

    wandb: bool = True
    """Log to Weights & Biases (a failure there never stops training)."""
    mode: str = "offline"
    """W&B mode: offline (default), online (needs a key), disabled."""
    project: str = "moe-rl"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); None = your default."""
    group: str | None = None
    """W&B group; None = the sweep folder's name (or the experiment for single runs)."""
    tags: list[str] = field(default_factory=list)
    """Extra W&B tags (objective, replay source and experiment are added)."""
    progress: bool = True
    """Show a progress bar."""
    init_timeout_s: float = 20.0
    """Seconds W&B may take to start (e.g. a server rejecting the key); then training goes on with
    local logs only, with a warning."""


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    """Seed of sampling, shuffling and the task stream (the model's init seed is model.seed)."""
    resume: bool = False
    """Continue from the run folder's last checkpoint (checkpoint.pt, or checkpoint.prev.pt when the
    latest is corrupt). A finished run is left as it is; a folder without a checkpoint starts fresh; a
    config that differs from the checkpoint's outside trainer.steps, trainer.checkpoint_every,
    trainer.threads, trainer.dist_timeout_s, warmstart.cache_dir and logger.* is refused."""
    resume_force: bool = False
    """With resume=true: continue even when the config differs from the checkpoint's (a warning lists
    the changed fields)."""
    experiment: str = "default"
    """Name of the experiment (set by conf/experiment/*.yaml); a W&B grouping field."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        check_finite(self)
        self.model.validate()
        check_pretrained(self.model.pretrained)
        if self.task.name not in TASKS:
            raise ValueError(f"task.name={self.task.name!r}: expected one of {sorted(TASKS)}")
        longest = make_task(self.task.name, self.task.difficulty).max_response_len + 1  # + EOS
        if self.sampler.max_new_tokens < longest:
            raise ValueError(
                f"sampler.max_new_tokens={self.sampler.max_new_tokens} is shorter than the longest "
                f"answer of task {self.task.name} at difficulty {self.task.difficulty} ({longest} "
                "tokens with EOS)"
            )
        o = self.objective
        if o.name not in OBJECTIVES:
            raise ValueError(f"objective.name={o.name!r}: expected one of {sorted(OBJECTIVES)}")
        if o.loss_agg not in AGGREGATIONS:
            raise ValueError(f"objective.loss_agg={o.loss_agg!r}: expected one of {sorted(AGGREGATIONS)}")
        if o.name != "grpo" and o.loss_agg != "seq-mean-token-mean":
            raise ValueError(f"objective.loss_agg={o.loss_agg!r}: {o.name} uses seq-mean-token-mean only")
        if not 0 <= o.clip_low < 1:
            raise ValueError(f"objective.clip_low={o.clip_low}: must be in [0, 1)")
        if o.clip_high < 0:
            raise ValueError(f"objective.clip_high={o.clip_high}: must be >= 0")
        if o.beta < 0:
            raise ValueError(f"objective.beta={o.beta}: must be >= 0")
        if len(o.extreme_band) != 2 or not 0 <= o.extreme_band[0] < 1 < o.extreme_band[1]:
            raise ValueError(
                f"objective.extreme_band={o.extreme_band}: expected [lo, hi] with 0 <= lo < 1 < hi"
            )
        if self.routing.replay not in REPLAY_SOURCES:
            raise ValueError(f"routing.replay={self.routing.replay!r}: expected one of {REPLAY_SOURCES}")
        self.sampler.validate()
        t = self.trainer
        for name in ("steps", "prompts_per_step", "mini_batches"):
            if getattr(t, name) < 1:
                raise ValueError(f"trainer.{name}={getattr(t, name)}: must be >= 1")
        if t.group_size < 2:
            raise ValueError(
                f"trainer.group_size={t.group_size}: must be >= 2 (advantages are group-relative)"
            )
        if (t.prompts_per_step * t.group_size) % t.mini_batches:
            raise ValueError(
                f"trainer.mini_batches={t.mini_batches} does not divide the rollout batch "
                f"prompts_per_step * group_size = {t.prompts_per_step * t.group_size}"
            )
        if t.lr <= 0:
            raise ValueError(f"trainer.lr={t.lr}: must be > 0")
        if t.grad_clip <= 0:
            raise ValueError(f"trainer.grad_clip={t.grad_clip}: must be > 0")
        if t.checkpoint_every < 0 or t.warmup_steps < 0 or t.threads < 0:
            raise ValueError(
                "trainer.checkpoint_every, trainer.warmup_steps and trainer.threads must be >= 0"
            )
        if t.sampler_dtype is not None and t.sampler_dtype not in DTYPES:
            raise ValueError(f"trainer.sampler_dtype={t.sampler_dtype!r}: expected one of {DTYPES} or null")
        if t.reuse_sampler_logp and t.sampler_dtype not in (None, self.model.dtype):
            raise ValueError(
                f"trainer.reuse_sampler_logp=true needs the sampler to be the trained model, but "
                f"trainer.sampler_dtype={t.sampler_dtype!r} samples with a {t.sampler_dtype} copy: set "
                "trainer.sampler_dtype=null or trainer.reuse_sampler_logp=false"
            )
        if t.parallel not in PARALLEL:
            raise ValueError(f"trainer.parallel={t.parallel!r}: expected one of {PARALLEL}")
        if t.dist_timeout_s < 1:
            raise ValueError(f"trainer.dist_timeout_s={t.dist_timeout_s}: must be >= 1")
        if self.task.chat_template and self.warmstart.enabled:
            raise ValueError(
                "task.chat_template=true needs warmstart.enabled=false: the warm start trains on plain prompts"
            )
        if t.device not in ("cpu", "cuda") and not t.device.startswith("cuda:"):
            raise ValueError(f"trainer.device={t.device!r}: expected cpu or cuda[:N]")
        c = self.collapse
        if not 0 < c.reward_frac < 1 or c.reward_window < 1 or c.ratio_max <= 1:
            raise ValueError(
                "collapse.reward_frac must be in (0, 1), collapse.reward_window >= 1, collapse.ratio_max > 1"
            )
        if self.logger.init_timeout_s <= 0:
            raise ValueError(f"logger.init_timeout_s={self.logger.init_timeout_s}: must be > 0")
        if self.logger.mode not in WANDB_MODES:
            raise ValueError(f"logger.mode={self.logger.mode!r}: expected one of {WANDB_MODES}")
        self.warmstart.validate()
        if self.seed < 0:
            raise ValueError(f"seed={self.seed}: must be >= 0")

    def check_machine(self) -> None:
        """Raise ValueError naming the field when this machine cannot run the config (trainer.device=cuda
        without CUDA). Separate from `validate`: configs for GPU machines still compose and validate anywhere."""
        device = self.trainer.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"trainer.device={device!r}: CUDA is not available on this machine; use cpu")


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


def check_pretrained(pretrained: str | None) -> None:
    """A `model.pretrained` that names a local folder must exist and hold a model (config.json);
    anything else that looks like a path (absolute, ./, ../, ~) but is no folder is refused too."""
    if not pretrained:
        return
    path = Path(pretrained).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model.pretrained={pretrained}: the folder holds no model (no config.json)")
        return
    if path.exists() or pretrained.startswith(("/", "./", "../", "~", ".")):
        raise ValueError(f"model.pretrained={pretrained}: no such model folder")
