"""TRL's GRPOTrainer on the reference workload, paired step by step with moe-rl in the same process.

TRL 1.16 (`pip install -e ".[bench]"`) trains a copy of the same initial model on the same prompts, with
the settings of issue #7: per_device_train_batch_size=64, num_generations=8, steps_per_generation=4
(4 optimizer steps per generation of 256 completions), importance_sampling_level="sequence",
loss_type="grpo", beta=0, 32 new tokens with every special token (EOS included) suppressed, no KL, no
load-balancing loss, AdamW with gradient clipping 1.0. One TRL "RL step" is its 4 optimizer steps,
generation and its old-policy forward included.

Pairing: a callback times each TRL RL step and then runs one RL step of each moe-rl variant, so the
systems alternate under the same machine conditions; the report takes the median of per-pair ratios.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable

import torch
from workload import AdditionTask

from moe_rl.tasks import Example


def _reward(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
    """moe-rl's own reward of the addition task, so both systems score completions alike."""
    task = AdditionTask(1)
    return [task.reward(Example(p, a, ()), c) for p, c, a in zip(prompts, completions, answer, strict=True)]


def build_trainer(model, tokenizer, prompts: list[str], answers: list[str], w, rl_steps: int, callbacks=()):
    """A GRPOTrainer for `rl_steps` RL steps of workload `w` (bench.Workload) on a copy of `model`."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    b = w.prompts * w.group // w.mini_batches
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_bench_"),
        per_device_train_batch_size=b,
        num_generations=w.group,
        steps_per_generation=w.mini_batches,
        gradient_accumulation_steps=1,
        num_iterations=1,
        importance_sampling_level="sequence",
        loss_type="grpo",
        beta=0.0,
        epsilon=w.clip_low,
        epsilon_high=w.clip_high,
        max_completion_length=w.new_tokens,
        temperature=1.0,
        generation_kwargs={"suppress_tokens": list(tokenizer.all_special_ids)},
        mask_truncated_completions=False,
        learning_rate=w.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        gradient_checkpointing=False,
        max_steps=rl_steps * w.mini_batches,
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=10**9,
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        seed=0,
        remove_unused_columns=False,
        dataloader_pin_memory=False,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts, "answer": answers}),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )


def paired_steps(
    model,
    tokenizer,
    prompts: list[str],
    answers: list[str],
    w,
    pairs: int,
    moe_rl: dict[str, Callable[[], float]],
) -> dict:
    """Run TRL for 1 + `pairs` RL steps; after each, one RL step of every moe-rl variant in `moe_rl`
    (name -> run one step, return its seconds). The first round warms up and is not reported."""
    from transformers import TrainerCallback

    times: dict[str, list[float]] = {"trl": [], **{name: [] for name in moe_rl}}

    class Pair(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step % w.mini_batches == 0:
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % w.mini_batches == 0:
                times["trl"].append(time.perf_counter() - self.t0)
                for name, step in moe_rl.items():
                    times[name].append(step())

    trainer = build_trainer(model, tokenizer, prompts, answers, w, pairs + 1, [Pair()])
    trainer.train()
    times = {k: v[1:] for k, v in times.items()}
    ratios = {name: [a / b for a, b in zip(times["trl"], times[name], strict=True)] for name in moe_rl}
    return {"seconds": times, "ratio": ratios}


@torch.no_grad()
def compare_losses(model, tokenizer, roll, adv_B: torch.Tensor, w) -> dict[str, dict[str, float]]:
    """GSPO and GRPO loss of TRL's `_compute_loss` and of moe-rl's objectives on identical inputs.

    Inputs: one moe-rl rollout (`roll`), its advantages, and old log-probs set to the current ones plus
    seeded noise (so that ratios differ from 1 and some sequences and tokens are clipped).
    """
    from moe_rl.objectives import OBJECTIVES
    from moe_rl.rollout import response_logprobs

    trainer = build_trainer(model, tokenizer, ["1+1="], ["2"], w, 1)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here
    R = roll.response_ids_BR.shape[1]
    mask_BR = roll.response_mask_BR
    logp_BR = response_logprobs(model, roll.input_ids_BS, roll.attention_mask_BS, R)
    noise_BR = torch.randn(logp_BR.shape, generator=torch.Generator().manual_seed(0))
    old_BR = logp_BR + 1e-3 * noise_BR
    inputs = {
        "prompt_ids": roll.prompt_ids_BP,
        "prompt_mask": roll.prompt_mask_BP,
        "completion_ids": roll.response_ids_BR,
        "completion_mask": mask_BR.long(),
        "advantages": adv_B,
        "old_per_token_logps": old_BR,
    }
    out = {}
    for name, level in (("gspo", "sequence"), ("grpo", "token")):
        trainer.importance_sampling_level = level
        trainer.model.train()
        trl_loss = float(trainer._compute_loss(trainer.model, inputs))
        ours, _ = OBJECTIVES[name](
            logp_BR,
            old_BR,
            adv_B,
            mask_BR,
            clip_low=w.clip_low,
            clip_high=w.clip_high,
            loss_agg="seq-mean-token-mean",
            max_len=w.new_tokens,
        )
        out[name] = {"trl": trl_loss, "moe_rl": float(ours), "abs_diff": abs(trl_loss - float(ours))}
    return out
