"""The reference RL workload of the benchmarks (issue #7), as a moe-rl `Config` and a ready `StepContext`.

Tiny Qwen3-MoE (hidden 128, 4 layers, 4 heads / 2 kv, head_dim 32, 8 experts top-2, expert FFN 128,
norm_topk_prob, seed 0, the character vocabulary), 32 single-digit addition prompts x 8 completions,
exactly 32 new tokens (EOS suppressed), temperature 1, 4 mini-batches of 64 completions, AdamW, grad
clip 1.0, no KL, no load-balancing loss, GSPO with clip 3e-4 / 4e-4, fp32 on CPU.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from moe_rl.config import Config
from moe_rl.startup import check_config
from moe_rl.tasks import Example
from moe_rl.tasks.arithmetic import ArithmeticTask
from moe_rl.trainer.run import build_context
from moe_rl.trainer.step import StepContext


@dataclass
class Workload:
    """One benchmark point; the defaults are the reference workload."""

    prompts: int = 32
    group: int = 8
    new_tokens: int = 32
    mini_batches: int = 4
    layers: int = 4
    experts: int = 8
    top_k: int = 2
    objective: str = "gspo"
    replay: str = "off"
    reuse_sampler_logp: bool = False
    lr: float = 1e-6
    clip_low: float = 3e-4
    clip_high: float = 4e-4
    device: str = "cpu"
    dtype: str = "float32"
    experts_impl: str = "grouped_mm"
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    expert_ffn: int = 128

    def replace(self, **changes) -> Workload:
        return dataclasses.replace(self, **changes)


class AdditionTask(ArithmeticTask):
    """Single-digit addition only (the arithmetic task at difficulty 1 also subtracts)."""

    def sample(self, rng: random.Random) -> Example:
        a, b = rng.randrange(10), rng.randrange(10)
        return Example(f"{a}+{b}=", str(a + b), (a, "+", b))


def config(w: Workload) -> Config:
    """The moe-rl config of workload `w` (no warm start: random initial weights, as TRL gets)."""
    cfg = Config()
    m = cfg.model
    m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads = w.hidden, w.layers, w.heads, w.kv_heads
    m.head_dim, m.num_experts, m.top_k, m.expert_ffn_size = w.head_dim, w.experts, w.top_k, w.expert_ffn
    m.experts_impl, m.dtype = w.experts_impl, w.dtype
    cfg.warmstart.enabled = False
    cfg.sampler.max_new_tokens, cfg.sampler.suppress_eos, cfg.sampler.temperature = w.new_tokens, True, 1.0
    t = cfg.trainer
    t.prompts_per_step, t.group_size, t.mini_batches = w.prompts, w.group, w.mini_batches
    t.lr, t.warmup_steps, t.weight_decay, t.grad_clip, t.device = w.lr, 0, 0.0, 1.0, w.device
    t.reuse_sampler_logp = w.reuse_sampler_logp
    cfg.objective.name = cfg.objective.preset = w.objective
    cfg.objective.clip_low, cfg.objective.clip_high = w.clip_low, w.clip_high
    cfg.routing.replay = w.replay
    cfg.logger.wandb, cfg.logger.progress = False, False
    check_config(cfg)
    return cfg


def context(w: Workload) -> StepContext:
    """A step context for `w`: the model built from seed 0, the addition task, fresh optimiser and RNGs."""
    ctx, _ = build_context(config(w))
    ctx.task = AdditionTask(1)
    return ctx


def prompts_and_answers(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """`n` addition prompts and their answers (the TRL dataset)."""
    examples = AdditionTask(1).examples("train", n, seed)
    return [ex.prompt for ex in examples], [ex.target for ex in examples]
