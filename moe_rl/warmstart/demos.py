"""Demonstrations: the canonical answer as tokens, teacher-forced batches and their loss, and held-out
accuracy by sampling. The bottom of the warm start: pretraining, the band search and eval use them.

Shape legend: B rows, S sequence length (prompt + response + EOS, right-padded), V vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_rl.rollout import SamplerConfig, position_ids_from_mask, sample
from moe_rl.tasks import Example, Task

if TYPE_CHECKING:  # annotations only: importing PreTrainedModel loads transformers' model code
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def answer_ids(tokenizer: PreTrainedTokenizerBase, task: Task, example: Example) -> list[int]:
    """The canonical answer as the sampler ends a response: the tokens of `task.solve(example)` (no
    special tokens), then EOS. The warm start's demonstrations and `eval/expected_accuracy` both use it."""
    return tokenizer(task.solve(example), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def demonstration_batch(
    tokenizer: PreTrainedTokenizerBase, task: Task, examples: list[Example]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `(input_ids_BS, attention_mask_BS, labels_BS)` of prompt + `answer_ids` (EOS included).

    labels are the input ids on response tokens (EOS included) and -100 on prompt and padding, so the
    loss is on what the policy must generate, never on the prompt it is given.
    """
    rows, n_prompt = [], []
    for ex in examples:
        prompt_ids = tokenizer(ex.prompt)["input_ids"]
        rows.append(prompt_ids + answer_ids(tokenizer, task, ex))
        n_prompt.append(len(prompt_ids))
    S = max(len(r) for r in rows)
    input_ids_BS = torch.full((len(rows), S), tokenizer.pad_token_id, dtype=torch.long)
    mask_BS = torch.zeros(len(rows), S, dtype=torch.long)
    labels_BS = torch.full((len(rows), S), -100, dtype=torch.long)
    for i, (row, p) in enumerate(zip(rows, n_prompt, strict=True)):
        input_ids_BS[i, : len(row)] = torch.tensor(row)
        mask_BS[i, : len(row)] = 1
        labels_BS[i, p : len(row)] = input_ids_BS[i, p : len(row)]
    return input_ids_BS, mask_BS, labels_BS


def demonstration_loss(
    model: PreTrainedModel,
    input_ids_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    labels_BS: torch.Tensor,
    aux_coef: float | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy over response tokens of the whole batch (token-level mean), plus
    `aux_coef` x the family's load-balancing loss when it is > 0; `aux_coef` None means the model
    config's `router_aux_loss_coef` (pretraining passes its own, `warmstart.pretrain_aux_loss_coef`)."""
    if aux_coef is None:
        aux_coef = getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0
    out = model(
        input_ids=input_ids_BS[:, :-1],
        attention_mask=mask_BS[:, :-1],
        position_ids=position_ids_from_mask(mask_BS[:, :-1]),
        use_cache=False,
        **({"output_router_logits": True} if aux_coef > 0 else {}),
    )
    logits_BSV = out.logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits_BSV.flatten(0, 1), labels_BS[:, 1:].flatten(), ignore_index=-100
    )
    return loss + aux_coef * out.aux_loss if aux_coef > 0 else loss


@torch.no_grad()
def heldout_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[Example],
    sampler_cfg: SamplerConfig,
    generator_seed: int,
) -> float:
    """Mean reward of one sampled response per example, in one batch, from a freshly seeded generator.

    Reseeding at every call uses the same random numbers for every checkpoint, so accuracy changes
    between evaluations reflect the weights rather than sampling noise.
    """
    was_training = model.training
    model.eval()
    rollout = sample(
        model,
        tokenizer,
        [ex.prompt for ex in examples],
        sampler_cfg,
        generator=torch.Generator(device=next(model.parameters()).device).manual_seed(generator_seed),
    )
    model.train(was_training)
    return sum(task.reward(ex, text) for ex, text in zip(examples, rollout.texts, strict=True)) / len(
        examples
    )
