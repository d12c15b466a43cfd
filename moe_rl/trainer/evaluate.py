"""Held-out evaluation during RL: the policy on a fixed set of the task's eval prompts.

Every run with the same task, difficulty and `eval.seed` evaluates the same `eval.size` prompts (the
eval split never meets the train split: moe_rl.tasks.base), with freshly seeded sampling noise at every
evaluation, so a change between evaluations reflects the weights, not the draw. Evaluation uses its own
generator and touches no training RNG, so turning it on or off never changes the training run.

| key | meaning |
|---|---|
| `eval/accuracy` | fraction of eval prompts answered correctly, one response each sampled as in RL (sampler.*) |
| `eval/accuracy_greedy` | the same with greedy decoding |
| `eval/response_len` | mean response tokens (EOS included) of the sampled responses |
| `time/eval_s` | wall seconds of the evaluation |
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moe_rl.rollout import SamplerConfig, sample
from moe_rl.tasks import Example, Task


@dataclass
class EvalConfig:
    """Held-out evaluation during RL (moe_rl.trainer.evaluate)."""

    every: int = 10
    """Evaluate after every N RL steps, and always after the last step (or a collapse stop); 0 = only at
    the end."""
    size: int = 64
    """Number of eval prompts (fixed per task, difficulty and seed); 0 turns evaluation off."""
    seed: int = 12345
    """Seed of the eval prompts and of the sampling noise (distinct from the warm start's eval set)."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        for name in ("every", "size", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"eval.{name}={getattr(self, name)}: must be >= 0")

    def due(self, step: int, last: bool) -> bool:
        """Whether to evaluate after RL step `step` (0-based)."""
        return self.size > 0 and (last or (self.every > 0 and (step + 1) % self.every == 0))


@torch.no_grad()
def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    prompts: list[str],
    examples: list[Example],
    sampler_cfg: SamplerConfig,
    seed: int,
) -> dict[str, float]:
    """`eval/*` metrics of `model` on `examples` (whose prompts, as the model sees them, are `prompts`)."""
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = {}
    try:
        for key, cfg in (
            ("eval/accuracy", sampler_cfg),
            ("eval/accuracy_greedy", dataclasses.replace(sampler_cfg, temperature=0.0)),
        ):
            roll = sample(model, tokenizer, prompts, cfg, generator=torch.Generator(device).manual_seed(seed))
            correct = [task.is_correct(ex, text) for ex, text in zip(examples, roll.texts, strict=True)]
            out[key] = sum(correct) / len(correct)
            if cfg is sampler_cfg:
                out["eval/response_len"] = roll.response_mask_BR.sum(1).double().mean().item()
    finally:
        model.train(was_training)
    out["time/eval_s"] = time.perf_counter() - t0
    return out
