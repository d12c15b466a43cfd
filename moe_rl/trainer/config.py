"""The RL loop's sections of the schema: `trainer`, `eval`, `collapse` and `logger`.

Each is composed into `moe_rl.config.Config`; each `validate` checks the fields of its own section (the
checks across sections are `Config.validate`'s). Imports no torch, so `import moe_rl.config` stays light.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from moe_rl.models.config import DTYPES

PARALLEL = ("ddp", "fsdp")
MAX_ROUTER_LR_SCALE = 1000.0
"""trainer.router_lr_scale's bound: far past any dose studied (30), short of an lr that only breaks a run."""
ESS_RULES = ("off", "sqrt", "linear")
"""trainer.ess_step_scale values (moe_rl/trainer/ess_scale.py)."""
WANDB_MODES = ("offline", "online", "disabled")


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
    group_minibatches: bool = False
    """False (default): each mini-batch takes rows from every group, so later mini-batches hold siblings
    (often identical responses) of rows just trained on (`minibatch/sibling_frac`, `duplicate_frac`).
    True: each mini-batch holds whole groups (P / M of them), as a contiguous split of a group-ordered
    batch does (verl's `ppo_mini_batch_size` counts prompts x n). Needs M to divide prompts_per_step."""
    lr: float = 1e-4
    """AdamW peak learning rate."""
    warmup_steps: int = 2
    """Linear learning-rate warmup, in optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    router_lr_scale: float = 1.0
    """The routers' learning rate as a multiple of `lr`: every parameter of every top-k router (the
    modules `moe_rl.routing.RoutingController` instruments) goes into its own AdamW parameter group at
    lr x this, with the same warmup. A natural volatility dose: gradient-driven re-routing that persists and
    that the sampler and eval see, raising expert change without raising the rest of the step. 1 (default):
    one parameter group, exactly the optimizer of runs before this field. `train/lr` stays the non-router lr.
    At most MAX_ROUTER_LR_SCALE (1000)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; null turns clipping off (the norm before clipping is
    logged either way: train/grad_norm, and how often and how much clipping acted)."""
    checkpoint_every: int = 10
    """Save a checkpoint every N RL steps (and at the end); 0 = only at the end."""
    threads: int = 0
    """torch CPU threads; 0 leaves torch's default."""
    device: str = "cpu"
    """Device of the model: cpu or cuda."""
    sampler_dtype: str | None = None
    """Sample with a separate copy of the policy in this dtype (e.g. bfloat16, as a low-precision
    inference engine would), synced after every step; None samples with the trained model itself.
    With sampler.engine=vllm, the engine's dtype (None: model.dtype)."""
    parallel: str = "ddp"
    """Under torchrun with several processes: ddp (each rank holds the whole model; gradients are
    all-reduced) or fsdp (FSDP2: parameters, gradients and optimizer state sharded over ranks)."""
    master_weights: bool = True
    """With a bfloat16/float16 model (model.dtype), AdamW updates float32 master copies of the parameters
    and rounds them back into the model after each step (moe_rl/trainer/precision.py), as mixed-precision
    trainers do; false updates the low-precision parameters in place, which rounds away every step below
    half a unit in the last place (most of them at lr <= 1e-4). No effect on float32/float64 models. Not
    available under FSDP (set false there)."""
    dist_timeout_s: int = 300
    """Seconds a collective waits for the other ranks before the job fails (a dead or hung rank)."""
    reuse_sampler_logp: bool = False
    """Skip the old-policy forward: use the sampler's log-probs and routing as the old policy's (GSPO
    paper, section 5.4). The same weights at the same precision compute them, so they agree with a full
    forward to float rounding (~1e-6), and the first mini-batch's ratios are 1 to that precision
    instead of exactly. Needs the sampler to be the trained model (trainer.sampler_dtype null)."""
    ess_step_scale: str = "off"
    """VCPO's step scale (arXiv 2602.17616; moe_rl/trainer/ess_scale.py): off, sqrt or linear. Each
    optimizer step's lr is multiplied by min(1, ESS/n)^(1/2) (sqrt) or min(1, ESS/n) (linear), ESS the
    effective sample size of the mini-batch's sequence weights π_old/μ, then restored, so the schedule is
    untouched; logged as train/ess_lr_factor. With a sampler that is the trained model the factor is 1."""
    export_hf: bool = False
    """Also write the policy in Hugging Face format (`policy/` in the run folder: `save_pretrained` of
    the model and tokenizer, plus moe_rl.json with the config and metrics) at every checkpoint. It is
    always written at the end of the run; see moe_rl/trainer/export.py."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field (the checks that read trainer.* alone)."""
        for name in ("steps", "prompts_per_step", "mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name}={getattr(self, name)}: must be >= 1")
        if self.group_size < 2:
            raise ValueError(
                f"trainer.group_size={self.group_size}: must be >= 2 (advantages are group-relative)"
            )
        if self.group_minibatches and self.prompts_per_step % self.mini_batches:
            raise ValueError(
                f"trainer.group_minibatches=true needs trainer.mini_batches={self.mini_batches} to divide "
                f"trainer.prompts_per_step={self.prompts_per_step} (each mini-batch holds whole groups)"
            )
        if (self.prompts_per_step * self.group_size) % self.mini_batches:
            raise ValueError(
                f"trainer.mini_batches={self.mini_batches} does not divide the rollout batch "
                f"prompts_per_step * group_size = {self.prompts_per_step * self.group_size}"
            )
        if self.lr <= 0:
            raise ValueError(f"trainer.lr={self.lr}: must be > 0")
        if not (math.isfinite(self.router_lr_scale) and 0 < self.router_lr_scale <= MAX_ROUTER_LR_SCALE):
            raise ValueError(
                f"trainer.router_lr_scale={self.router_lr_scale}: must be in (0, {MAX_ROUTER_LR_SCALE:g}] (the routers' "
                "lr is trainer.lr x this; 1 trains them at trainer.lr; the studies here use up to 30)"
            )
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"trainer.grad_clip={self.grad_clip}: must be > 0, or null for no clipping")
        if self.checkpoint_every < 0 or self.warmup_steps < 0 or self.threads < 0:
            raise ValueError(
                "trainer.checkpoint_every, trainer.warmup_steps and trainer.threads must be >= 0"
            )
        if self.sampler_dtype is not None and self.sampler_dtype not in DTYPES:
            raise ValueError(f"trainer.sampler_dtype={self.sampler_dtype!r}: expected one of {DTYPES} or null")
        if self.parallel not in PARALLEL:
            raise ValueError(f"trainer.parallel={self.parallel!r}: expected one of {PARALLEL}")
        if self.ess_step_scale not in ESS_RULES:
            raise ValueError(f"trainer.ess_step_scale={self.ess_step_scale!r}: expected one of {ESS_RULES}")
        if self.dist_timeout_s < 1:
            raise ValueError(f"trainer.dist_timeout_s={self.dist_timeout_s}: must be >= 1")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"trainer.device={self.device!r}: expected cpu or cuda[:N]")


@dataclass
class EvalConfig:
    """Held-out evaluation during RL (moe_rl.trainer.evaluate)."""

    every: int = 10
    """Evaluate after every N RL steps, and always after the last step (or a collapse stop); 0 = only at
    the end."""
    size: int = 64
    """Number of eval prompts sampled as in RL (`eval/accuracy`); 0 turns sampled evaluation off."""
    expected_size: int = 512
    """Number of eval prompts scored teacher-forced (`eval/expected_accuracy`) and greedily
    (`eval/accuracy_greedy`); 0 turns both off. With `size` 0 too, evaluation is off."""
    batch_size: int = 128
    """Prompts per forward of the teacher-forced and greedy evaluations (memory, not results)."""
    at_start: bool = True
    """Also evaluate before the first update (`eval/initial/*` in step 0's row; not repeated on resume)."""
    seed: int = 12345
    """Seed of the eval prompts and of the sampling noise (distinct from the warm start's eval set)."""
    fit_heldout: bool = True
    """task=dataset: when the dataset holds out fewer rows than `size` or `expected_size` ask for, evaluate
    on all of its held-out rows instead, with a one-line note (a 200-row file holds out 20); false refuses
    such a run at start-up."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        for name in ("every", "size", "expected_size", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"eval.{name}={getattr(self, name)}: must be >= 0")
        if self.batch_size < 1:
            raise ValueError(f"eval.batch_size={self.batch_size}: must be >= 1")

    @property
    def enabled(self) -> bool:
        """Whether any evaluation runs."""
        return self.size > 0 or self.expected_size > 0

    @property
    def prompts_needed(self) -> int:
        """How many prompts of the eval stream the evaluations use."""
        return max(self.size, self.expected_size)

    def fitted(self, heldout: int) -> EvalConfig:
        """This config with `size` and `expected_size` at most `heldout` (a dataset's held-out rows) when
        `fit_heldout`; unchanged otherwise, or when nothing is held out."""
        if not self.fit_heldout or heldout < 1:
            return self
        return dataclasses.replace(self, size=min(self.size, heldout), expected_size=min(self.expected_size, heldout))

    def due(self, step: int, last: bool) -> bool:
        """Whether to evaluate after RL step `step` (0-based)."""
        return self.enabled and (last or (self.every > 0 and (step + 1) % self.every == 0))


COLLAPSE_KINDS = ("nonfinite", "reward_collapse", "eval_regression", "entropy_collapse", "ratio_blowup")
"""Every kind of collapse event (moe_rl.trainer.collapse)."""
FAILURE_KINDS = ("nonfinite", "reward_collapse", "eval_regression", "entropy_collapse")
"""The kinds that say the run is failing; `ratio_blowup` is a signal of the mechanism, not a failure."""


@dataclass
class CollapseConfig:
    """Collapse-event detection (moe_rl.trainer.collapse; the two level tests: moe_rl.trainer.changepoint).
    The defaults keep the false-alarm rate of reward_collapse at ≤ 0.05 per 500-step run in every cell of
    experiments/reward_collapse_fp.py (docs/reliability.md)."""

    warmup_steps: int = 5
    """Steps before reward and entropy collapse are watched (the reward test ignores these steps)."""
    reward_window: int = 20
    """Reward collapse: W, the steps whose mean reward is the reference level (the W steps before the
    current excursion); nothing can fire in a run's first warmup_steps + W steps."""
    reward_frac: float = 0.5
    """Reward collapse: the fall the test is tuned to, the true mean reward at this fraction of the
    reference level; a fall to less than (1 + frac) / 2 of it accumulates no evidence."""
    reward_arl0: float = 2e4
    """Reward collapse: average run length (steps) between false alarms of a reward that never moves, for
    Gaussian noise (Siegmund's approximation) from which the CUSUM's threshold is set; a run of T steps then
    false-alarms with probability about T / reward_arl0 (measured: experiments/reward_collapse_fp.py)."""
    reward_margin: float = 1.0
    """Reward collapse: the reference level is taken this many standard errors of its own mean below the
    window's mean, so a lucky window does not set a level the policy never had."""
    eval_frac: float = 0.5
    """Eval regression: as reward_frac, for `eval/expected_accuracy` (one observation per evaluation)."""
    eval_window: int = 3
    """Eval regression: evaluations in the reference level (the initial one counts)."""
    eval_arl0: float = 1e3
    """Eval regression: average run length between false alarms, in evaluations."""
    eval_margin: float = 1.0
    """Eval regression: as reward_margin."""
    entropy_min: float = 0.02
    """Entropy collapse: mean sampler token entropy (nats) below this."""
    ratio_max: float = 1e3
    """Ratio blow-up: the ratio the objective uses (token or sequence) above ratio_max or below 1 / ratio_max."""
    stop_on_collapse: bool = False
    """Stop the run at the first event of a kind in `stop_kinds`; the summary says so."""
    stop_kinds: list[str] = field(default_factory=lambda: list(FAILURE_KINDS))
    """The kinds `stop_on_collapse` stops on (default: those that say the run is failing)."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        for name in ("reward_frac", "eval_frac"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"collapse.{name}={getattr(self, name)}: must be in (0, 1)")
        for name in ("reward_window", "eval_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"collapse.{name}={getattr(self, name)}: must be >= 1")
        for name in ("reward_arl0", "eval_arl0"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"collapse.{name}={getattr(self, name)}: must be >= 1 (observations)")
        for name in ("reward_margin", "eval_margin", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"collapse.{name}={getattr(self, name)}: must be >= 0")
        if not self.ratio_max > 1:
            raise ValueError(f"collapse.ratio_max={self.ratio_max}: must be > 1")
        check_kinds("collapse.stop_kinds", self.stop_kinds)
        if self.stop_on_collapse and not self.stop_kinds:
            raise ValueError("collapse.stop_on_collapse=true with collapse.stop_kinds=[]: a stop that can never fire; "
                             "name the kinds to stop on, or set collapse.stop_on_collapse=false")


def check_kinds(name: str, kinds: list[str]) -> None:
    """Raise ValueError naming the field when `kinds` holds a name that is not a collapse kind."""
    unknown = [k for k in kinds if k not in COLLAPSE_KINDS]
    if unknown:
        raise ValueError(f"{name}={list(kinds)}: unknown kind(s) {unknown}; expected some of {list(COLLAPSE_KINDS)}")


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
    alerts: bool = True
    """On each collapse event call `wandb.alert` (title: the kind; text: the step and the values that
    tripped it) and tag the run `collapsed:<kind>`, so a W&B filter finds collapsed runs."""
    alert_kinds: list[str] = field(default_factory=lambda: list(FAILURE_KINDS))
    """The collapse kinds that raise alerts and `collapsed:<kind>` tags (default: those that say the run is
    failing; add `ratio_blowup` to be alerted on the mechanism signal too)."""
    alert_interval_s: float = 300.0
    """Rate limit: at most one alert per collapse kind in this many seconds (also passed to W&B as the
    alert's wait_duration); the tag is added on the first event of each kind."""
    init_timeout_s: float = 20.0
    """Seconds W&B may take to start (e.g. a server rejecting the key); then training goes on with
    local logs only, with a warning."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        check_kinds("logger.alert_kinds", self.alert_kinds)
        if self.init_timeout_s <= 0:
            raise ValueError(f"logger.init_timeout_s={self.init_timeout_s}: must be > 0")
        if self.mode not in WANDB_MODES:
            raise ValueError(f"logger.mode={self.mode!r}: expected one of {WANDB_MODES}")
        if self.alert_interval_s < 0:
            raise ValueError(f"logger.alert_interval_s={self.alert_interval_s}: must be >= 0")
