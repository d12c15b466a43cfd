"""Pretraining stage of the warm start: broad data with load balancing, before the run's task.

The task-only warm start trains a random model on one task with no balancing, so its routers end up
decisive and imbalanced (docs/results.md). A pretrained MoE's routers were trained on broad data with a
load-balancing loss. `pretrain` does that in miniature: `warmstart.pretrain_steps` AdamW steps at
`warmstart.lr` on demonstrations of `BroadTask(TASKS)` (every task family at every difficulty, uniformly),
with loss

    L = CE(response tokens) + pretrain_aux_loss_coef * L_aux,

L_aux the family's own load-balancing loss (transformers' `load_balancing_loss_func`, Switch Transformer
eq. 4-6) over every non-padding token, prompts included. Then `warm_start`'s band search fine-tunes on the
run's task with a fresh optimizer and `model.router_aux_loss_coef`.

Where it departs from LM pretraining: the loss is on responses only, as in the band search; the prompts
are random draws (operands, digits to sort) with nothing to learn beyond their alphabet, and the routers
still see every prompt token in the forward (and in L_aux). Fixed budget, no stopping rule, no eval:
pretraining's job is the routers' state, and the band search measures what the policy can do.

Determinism: the examples come from `random.Random(f"pretrain:{seed}")` (string seeds hash with sha512,
independent of PYTHONHASHSEED), a stream separate from the band search's; nothing else is random.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from moe_rl.tasks import TASKS, BroadTask
from moe_rl.warmstart.config import WarmStartConfig
from moe_rl.warmstart.demos import demonstration_batch, demonstration_loss

if TYPE_CHECKING:  # annotations only: importing PreTrainedModel loads transformers' model code
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def pretrain_stream(seed: int) -> random.Random:
    """The pretraining examples' RNG of run seed `seed`."""
    return random.Random(f"pretrain:{seed}")


def pretrain(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    ws_cfg: WarmStartConfig,
    seed: int,
    progress: bool,
) -> dict[str, Any]:
    """Train `model` in place for `ws_cfg.pretrain_steps` steps on the broad mixture (module docstring).

    Returns stats for warmstart.json: `pretrain_steps`, `pretrain_loss` (the last step's loss) and
    `pretrain_history`, the mean loss of each span of `eval_every` steps.
    """
    task = BroadTask(TASKS)
    rng = pretrain_stream(seed)
    device = next(model.parameters()).device
    optim = torch.optim.AdamW(model.parameters(), lr=ws_cfg.lr)
    history: list[dict[str, float]] = []
    span: list[float] = []
    loss = float("nan")
    model.train()
    with tqdm(total=ws_cfg.pretrain_steps, desc="pretrain broad mixture", disable=not progress) as bar:
        for step in range(1, ws_cfg.pretrain_steps + 1):
            batch = demonstration_batch(tokenizer, task, [task.sample(rng) for _ in range(ws_cfg.batch_size)])
            loss_t = demonstration_loss(
                model, *(t.to(device) for t in batch), aux_coef=ws_cfg.pretrain_aux_loss_coef
            )
            optim.zero_grad(set_to_none=True)
            loss_t.backward()
            optim.step()
            loss = loss_t.item()
            span.append(loss)
            if len(span) == ws_cfg.eval_every or step == ws_cfg.pretrain_steps:
                history.append(dict(step=step, loss=sum(span) / len(span)))
                span = []
            bar.set_postfix(dict(step=str(step), loss=f"{loss:.3f}"), refresh=False)
            bar.update(1)
    model.eval()
    return dict(pretrain_steps=ws_cfg.pretrain_steps, pretrain_loss=loss, pretrain_history=history)
