"""The warm start's schema (`WarmStartConfig`, the `warmstart` section of `moe_rl.config.Config`), its
result, and the cache format's constants. Imports no torch, so `import moe_rl.config` stays light."""

from __future__ import annotations

from dataclasses import dataclass

FORMAT_VERSION = 2
"""Bump when the training procedure changes so old cache entries stop matching (2: fixed build
threads, device type in the key, checksums in warmstart.json)."""

BUILD_THREADS = 2
"""torch CPU threads of every build, whatever the caller's: reductions split by thread count round
differently, so one key built on 1 and on 2 threads gave different weights (max |dw| 0.108 in a probe).
Any fixed count makes builds reproducible; 2 is the count the test suite runs with (tests/conftest.py),
whose 1-vs-2-process comparison (tests/integration/test_torchrun_data_parallel.py, atol 1e-4) holds from these weights and
missed by 1e-5 on 2 of 1024 elements from a 1-thread build."""

META_FILE = "warmstart.json"


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
class WarmStartResult:
    """A finished warm start.

    path: directory loadable by `build_model(ModelConfig(pretrained=path))` and `AutoTokenizer.from_pretrained`.
    accuracy: held-out accuracy of the saved model (eval split, `eval_size` examples, eval temperature).
    steps: optimizer steps in the saved model's history (rolled-back steps excluded).
    cached: True when the result was loaded from the cache rather than trained by this call.
    seconds: wall time of this call, lock wait included.
    """

    path: str
    accuracy: float
    steps: int
    cached: bool
    seconds: float


__all__ = ["BUILD_THREADS", "FORMAT_VERSION", "META_FILE", "WarmStartConfig", "WarmStartResult"]
