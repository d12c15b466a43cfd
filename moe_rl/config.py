"""Typed configuration: the schema Hydra composes the YAML in `conf/` onto.

The entry point converts the composed config once with `OmegaConf.to_object` into `Config`, then
calls `Config.validate()`, which raises `ValueError` naming the first bad field before any compute.
Each section validates its own fields (`ObjectiveConfig.validate`, ...); `Config.validate` adds the
checks that read more than one section. The schema does no I/O: the start-up checks that read files,
build the task or look at the machine are in `moe_rl.startup`, above it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from moe_rl.models.config import DTYPES, ModelConfig
from moe_rl.objectives import OBJECTIVES, validate_config
from moe_rl.objectives.config import ObjectiveConfig
from moe_rl.rollout.sampler import SamplerConfig
from moe_rl.tasks.config import DATASET, TaskConfig

INFINITE_OK = ("collapse.ratio_max",)
"""Float fields where +inf is meaningful (a threshold that never fires); NaN is refused everywhere."""

REPLAY_SOURCES = ("off", "old", "rollout")
NOISE_GROWTH = ("sqrt", "constant")
NOISE_SCOPES = ("update", "trainer")
PARALLEL = ("ddp", "fsdp")
MAX_ROUTER_LR_SCALE = 1000.0
"""trainer.router_lr_scale's bound: far past any dose studied (30), short of an lr that only breaks a run."""
ESS_RULES = ("off", "sqrt", "linear")
"""trainer.ess_step_scale values (moe_rl/trainer/ess_scale.py)."""
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class RoutingConfig:
    """Routing replay: which recorded routing the update forwards use."""

    replay: str = "off"
    """off: routers choose freely; old: the old-policy forward's routing (Routing Replay, R2);
    rollout: the sampler's routing in the old-policy and update forwards (rollout routing replay, R3)."""
    drift: float = 0.0
    """Injected routing drift p in [0, 1]: *expert dropout* in the policy's update forwards, not re-routing.
    In a fraction p of (token, MoE layer) slots one of the router's top-k experts (uniformly, so half the
    time the top-1 at top-2) is swapped for a uniformly random one it did not choose (moe_rl.routing.Drift),
    whatever the router's margins; the swapped-in expert's gate comes from the live router. At matched
    expert change it moves log-probs several times more than natural re-routing or routing.logit_noise
    (moe-rl-calibrate), and it cannot tell R2 from R3 (both switch it off). Expert change grows by about p / top_k. The sampler and
    the old-policy forward never drift, and replay wins: under routing.replay=old or rollout the replayed
    experts are used and the drift has no effect. Draws come from their own generator, seeded from
    (seed, step, mini-batch), so changing p never changes the rollouts."""
    drift_from_minibatch: int = 2
    """First mini-batch (1-based) of each step whose update forward drifts. 2 (default): only the
    off-policy mini-batches, modelling update-induced volatility (GSPO paper, section 5.3). 1: the
    on-policy mini-batch too, modelling sampler/trainer routing mismatch (as studied for R3)."""
    logit_noise: float = 0.0
    """Router-logit noise σ >= 0: the paper's expert volatility as a control (moe_rl.routing.noise). The
    perturbed forwards take their top-k on logits + σ_j·ε, ε ~ N(0, 1) per (step, row, token position,
    layer, expert), the same ε in every forward of the step; gates come from the live logits, as under
    replay. So only tokens whose k-th and (k+1)-th logits nearly tie flip, to the runner-up. σ_j is set
    by routing.noise_growth; which forwards are perturbed by routing.noise_scope. Replay wins. Unlike
    routing.drift (expert dropout: a uniformly random swap whatever the margins), this is re-routing."""
    noise_growth: str = "sqrt"
    """sqrt (default): mini-batch j (1-based) uses σ·sqrt(j - 1), so the on-policy mini-batch is exact and
    the change grows with staleness, like a random walk of the router over the updates it has seen.
    constant: σ in every perturbed forward (needed by noise_scope=trainer)."""
    noise_scope: str = "update"
    """update (default): only the update forwards are perturbed (update-induced volatility); R2 and R3
    replay the old policy's or the sampler's clean routing, so both are immune. trainer: the old-policy
    forward and the update forwards alike, with one ε, against a clean sampler (sampler/trainer routing
    mismatch): R2 replays the old forward's perturbed routing, so only R3 is immune."""
    replay_gates: bool = False
    """Under replay (old or rollout): combine the replayed experts with the recorded gates too, not the live
    router's softmax over them (prime-rl's "total router recall" draft). The update forward then reproduces
    the recorded forward's mixture exactly, and the loss sends the routers no gradient (only the
    load-balancing loss, model.router_aux_loss_coef, trains them). False (default): ids only, gates live."""
    replay_score_ratio: float = 0.0
    """Partial replay (prime-rl's score-threshold router replay, PR #2703), ratio in [0, 1]: a replayed expert
    is kept only if the trainer router's own score for it (its softmax over the experts) is >= ratio x the
    weakest score in the trainer's own top-k; a rejected slot is refilled, in rank order, from the trainer's
    own top-k, never duplicating an expert (moe_rl.routing.partial). Logged as routing/replay_replace_rate.
    0 (default): plain replay. Needs routing.replay=old or rollout, and live gates (replay_gates=false)."""
    freeze_router: bool = False
    """Keep every router's weights fixed for the whole run (no gradient, no optimizer update, not even from
    the load-balancing loss). With routing.replay_gates=true this is prime-rl's "total router recall"
    exactly: replayed ids, replayed gates, router frozen. Needs routing.replay_gates=true."""
    weight_noise: float = 0.0
    """Persistent alternative, σ_w >= 0: after each optimizer step every router's weight matrix gets
    N(0, σ_w²) added element-wise (seeded from (seed, step, mini-batch)), so the perturbation is part of
    the policy: the sampler, the old-policy forward and eval all see it, and it accumulates."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field (the checks that read routing.* alone)."""
        if self.replay not in REPLAY_SOURCES:
            raise ValueError(f"routing.replay={self.replay!r}: expected one of {REPLAY_SOURCES}")
        if not 0 <= self.drift <= 1:  # also false for NaN
            raise ValueError(f"routing.drift={self.drift}: must be in [0, 1]")
        if self.drift_from_minibatch < 1:
            raise ValueError(f"routing.drift_from_minibatch={self.drift_from_minibatch}: must be >= 1")
        if self.logit_noise < 0 or self.weight_noise < 0:
            raise ValueError(
                f"routing.logit_noise={self.logit_noise}, routing.weight_noise={self.weight_noise}: must be >= 0"
            )
        if self.replay_gates and self.replay == "off":
            raise ValueError(
                "routing.replay_gates=true replays recorded gates with the replayed experts, so it needs "
                "routing.replay=old or rollout"
            )
        if not 0 <= self.replay_score_ratio <= 1:
            raise ValueError(f"routing.replay_score_ratio={self.replay_score_ratio}: must be in [0, 1]")
        if self.replay_score_ratio and self.replay == "off":
            raise ValueError(
                f"routing.replay_score_ratio={self.replay_score_ratio} filters replayed experts, so it needs "
                "routing.replay=old or rollout"
            )
        if self.replay_score_ratio and self.replay_gates:
            raise ValueError(
                f"routing.replay_score_ratio={self.replay_score_ratio} refills rejected slots from the live router, "
                "which has no recorded gate for them: set routing.replay_gates=false or replay_score_ratio=0"
            )
        if self.freeze_router and not self.replay_gates:
            raise ValueError(
                "routing.freeze_router=true is total router recall with routing.replay_gates=true (replayed ids "
                "and gates, router fixed): set routing.replay_gates=true (and routing.replay=old or rollout)"
            )
        if self.noise_growth not in NOISE_GROWTH:
            raise ValueError(f"routing.noise_growth={self.noise_growth!r}: expected one of {NOISE_GROWTH}")
        if self.noise_scope not in NOISE_SCOPES:
            raise ValueError(f"routing.noise_scope={self.noise_scope!r}: expected one of {NOISE_SCOPES}")
        if self.logit_noise > 0 and self.drift > 0:
            raise ValueError(
                f"routing.logit_noise={self.logit_noise} and routing.drift={self.drift}: choose one perturbation"
            )
        if self.logit_noise > 0 and self.noise_scope == "trainer" and self.noise_growth != "constant":
            raise ValueError(
                "routing.noise_scope=trainer perturbs the old-policy forward, which has seen no update, "
                "so its noise cannot grow with staleness: set routing.noise_growth=constant"
            )


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
class RolloutConfig:
    """When the rollouts a step trains on were sampled: bounded staleness (moe_rl/trainer/stale.py).

    Step t trains on rollouts the policy of step t - k sampled (the weights at the start of step t - k;
    the first k steps' come from the initial policy, so their staleness is t). The behaviour policy is
    then the stale sampler and the proximal policy of the clip is the trainer's policy at the start of
    step t, as AReaL's decoupled PPO has it (docs/objectives.md)."""

    staleness: int = 0
    """k, in RL steps (policy versions). 0: today's loop, each step samples with its own weights."""
    overlap: bool = False
    """False (default): deterministic staleness. Each step samples the rollouts of step t + k with its
    weights and keeps them until then, so runs are reproducible and resume bit-exactly. True: a background
    thread samples steps t + 1 ... t + k with its own copy of the policy while the trainer trains step t,
    and takes the trainer's weights after every optimizer step of the trainer's RL steps (each rollout
    records the version that sampled it: `staleness/*`). Needs staleness >= 1 and one process."""
    sampler_threads: int = 0
    """With overlap: the background sampler's torch threads; 0 gives it half the cores (at least 1), and
    trainer.threads=0 then gives the trainer the rest."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field (the checks that read rollout.* alone)."""
        if self.staleness < 0:
            raise ValueError(
                f"rollout.staleness={self.staleness}: must be >= 0 (the number of steps a rollout waits; 0 samples "
                "with each step's own weights)"
            )
        if self.sampler_threads < 0:
            raise ValueError(f"rollout.sampler_threads={self.sampler_threads}: must be >= 0 (0: half the cores)")
        if self.overlap and self.staleness < 1:
            raise ValueError(
                "rollout.overlap=true samples ahead while the trainer trains, so it needs rollout.staleness >= 1 "
                "(the steps the sampler may run ahead)"
            )


@dataclass
class WarmStartConfig:
    """Supervised warm start before RL (see moe_rl.warmstart for the stopping rule and the cache)."""

    enabled: bool = True
    """Run the warm start before RL; when false RL starts from the config-built model."""
    target_low: float = 0.2
    """Lower edge of the held-out accuracy band: below it RL groups are mostly all-zero."""
    target_high: float = 0.6
    """Upper edge of the band: above it the task is mostly solved and RL has little left to learn."""
    max_steps: int = 2000
    """Most optimizer steps, including steps discarded by a rollback after an overshoot."""
    batch_size: int = 64
    """Demonstrations per optimizer step."""
    lr: float = 3e-3
    """AdamW learning rate (halved at each rollback)."""
    eval_every: int = 25
    """Optimizer steps between held-out evaluations (1 after the first overshoot)."""
    eval_size: int = 128
    """Held-out eval-split examples per evaluation, sampled in one batch."""
    eval_temperature: float = 1.0
    """Sampling temperature of the accuracy check; 0 means greedy. Default 1.0, the RL temperature,
    because what RL needs is the success rate of its *samples*: greedy accuracy can be far higher."""
    cache_dir: str = "~/.cache/moe-rl/warmstart"
    """Where finished warm starts are kept (not part of the cache key)."""
    seed: int = 0
    """Seed of the held-out eval examples, fixed across run seeds so every run is judged on one set."""
    build_seed: int | None = None
    """None (default): each run seed builds (and caches) its own warm start, so seeds also vary the
    starting policy. An integer: every run starts from the warm start built with this seed, one policy
    shared by all run seeds (as every arm of the paper starts from one checkpoint); run seeds then vary
    only RL's sampling and shuffling, and one build serves a whole sweep. The cache key holds the seed
    used, not this field: build_seed=3 reuses the entry a run with seed=3 built."""
    pretrain_steps: int = 0
    """Optimizer steps of *pretraining* on the broad mixture (`moe_rl.tasks.BroadTask`: every task family
    at every difficulty) before the band search on the run's task, with load balancing on
    (`pretrain_aux_loss_coef`), so the routers start like a pretrained MoE's: trained on broad data,
    balanced. 0 (default) skips it: the warm start is the task-only one that published results used, and
    its cache keys are unchanged. Uses `batch_size` and `lr`; the band search then starts a fresh AdamW,
    as fine-tuning a pretrained checkpoint does (`moe_rl.warmstart.pretrain`)."""
    pretrain_aux_loss_coef: float = 0.01
    """Load-balancing coefficient of pretraining only (the family's aux loss, transformers'
    load_balancing_loss_func). Separate from `model.router_aux_loss_coef`, which also enters the band
    search and every RL update: a pretrained MoE is balanced in pretraining whatever its fine-tuning
    does. 0.01 is Switch Transformer's and OLMoE's coefficient. Ignored (and not in the cache key) when
    `pretrain_steps` = 0."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if not 0 <= self.target_low < self.target_high <= 1:
            raise ValueError(
                f"warmstart.target_low={self.target_low}, warmstart.target_high={self.target_high}: "
                "need 0 <= target_low < target_high <= 1"
            )
        for name in ("max_steps", "batch_size", "eval_every", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"warmstart.{name}={getattr(self, name)}: must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"warmstart.lr={self.lr}: must be > 0")
        if self.eval_temperature < 0:
            raise ValueError(f"warmstart.eval_temperature={self.eval_temperature}: must be >= 0 (0 = greedy)")
        if not self.cache_dir:
            raise ValueError("warmstart.cache_dir is empty: give a directory for finished warm starts")
        if self.seed < 0:
            raise ValueError(f"warmstart.seed={self.seed}: must be >= 0")
        if self.build_seed is not None and self.build_seed < 0:
            raise ValueError(f"warmstart.build_seed={self.build_seed}: must be >= 0 or null")
        if self.pretrain_steps < 0:
            raise ValueError(f"warmstart.pretrain_steps={self.pretrain_steps}: must be >= 0 (0 = no pretraining)")
        if not self.pretrain_aux_loss_coef >= 0:
            raise ValueError(f"warmstart.pretrain_aux_loss_coef={self.pretrain_aux_loss_coef}: must be >= 0")


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
        if OBJECTIVES[self.objective.name].needs_topk and self.sampler.keep_sampling_mask:
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
        if sp.engine == "vllm" and self.routing.replay_gates and self.routing.replay == "rollout":
            raise ValueError(
                "routing.replay_gates=true under routing.replay=rollout needs the sampler's gates, and "
                "sampler.engine=vllm records expert ids only: set routing.replay_gates=false or sampler.engine=hf"
            )
        if sp.engine == "vllm" and t.reuse_sampler_logp:
            raise ValueError(
                "trainer.reuse_sampler_logp=true takes the sampler's log-probs and routes as the old policy's, "
                "which holds only for the trained model itself, not for sampler.engine=vllm: set "
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
            if sp.engine == "vllm":
                raise ValueError(
                    "model.router_dtype with sampler.engine=vllm: the engine sets its own router dtype; set "
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
        if ro.overlap and self.sampler.engine == "vllm":
            raise ValueError(
                "rollout.overlap=true is not available with sampler.engine=vllm (its in-process engine cannot "
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
