"""The band search: train on demonstrations until held-out accuracy lies in [target_low, target_high],
rolling back to the last evaluation below the band (and halving the learning rate) on an overshoot
(moe_rl.warmstart's docstring states the rule)."""

from __future__ import annotations

import copy
import math
import random
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from moe_rl.rollout import SamplerConfig
from moe_rl.tasks import Task, split_seed
from moe_rl.warmstart.config import WarmStartConfig
from moe_rl.warmstart.demos import demonstration_batch, demonstration_loss, heldout_accuracy

if TYPE_CHECKING:  # annotations only: importing PreTrainedModel loads transformers' model code
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

LR_BACKOFF = 0.5
"""Learning-rate factor applied at each rollback after an overshoot."""


@dataclass
class _Snapshot:
    """Model and optimizer state at one evaluation, to roll back to or to return."""

    accuracy: float
    steps: int
    model_state: dict[str, torch.Tensor]
    optim_state: dict[str, Any]


def _snapshot(model: PreTrainedModel, optim: torch.optim.Optimizer, accuracy: float, steps: int) -> _Snapshot:
    model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _Snapshot(accuracy, steps, model_state, copy.deepcopy(optim.state_dict()))


def _restore(model: PreTrainedModel, optim: torch.optim.Optimizer, snap: _Snapshot, lr: float) -> None:
    model.load_state_dict(snap.model_state)
    optim.load_state_dict(copy.deepcopy(snap.optim_state))
    for group in optim.param_groups:
        group["lr"] = lr


def _postfix(steps: int, loss: float, accuracy: float, lr: float, band: tuple[float, float]) -> dict[str, str]:
    """Progress-bar fields: steps of the current weights, last training loss, last held-out accuracy
    against the target band it must land in, lr."""
    shown = f"{loss:.3f}" if math.isfinite(loss) else "–"  # no training step yet: no loss to show
    return dict(step=str(steps), loss=shown, acc=f"{accuracy:.3f}", target=f"[{band[0]:g}, {band[1]:g}]",
                lr=f"{lr:.1e}")


def band_search(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    ws_cfg: WarmStartConfig,
    seed: int,
    max_new_tokens: int,
    progress: bool,
) -> tuple[float, int, dict[str, Any]]:
    """Train `model` in place until held-out accuracy is in the band; return (accuracy, steps, stats)."""
    low, high = ws_cfg.target_low, ws_cfg.target_high
    train_rng = random.Random(split_seed("train", seed))  # one fresh stream, never replayed after a rollback
    eval_examples = task.examples("eval", ws_cfg.eval_size, ws_cfg.seed)
    sampler_cfg = SamplerConfig(temperature=ws_cfg.eval_temperature, max_new_tokens=max_new_tokens)
    device = next(model.parameters()).device
    optim = torch.optim.AdamW(model.parameters(), lr=ws_cfg.lr)
    lr, eval_every, steps, steps_total, rollbacks, loss = ws_cfg.lr, ws_cfg.eval_every, 0, 0, 0, float("nan")
    below: _Snapshot | None = None  # last evaluation below the band
    above: _Snapshot | None = None  # overshoot closest to the band, returned only if the budget runs out
    history: list[dict[str, float]] = []
    # The bar's total is the budget; a build usually stops well before it (sort_long: ~500 of 2000 steps).
    desc = f"warm start {task.name} (once, then cached)"
    with tqdm(total=ws_cfg.max_steps, desc=desc, unit="step", disable=not progress) as bar:
        while True:
            bar.set_description(f"{desc}: held-out eval", refresh=True)  # minutes on a slow machine
            accuracy = heldout_accuracy(model, tokenizer, task, eval_examples, sampler_cfg, seed)
            bar.set_description(desc, refresh=False)
            history.append(dict(step=steps, steps_total=steps_total, accuracy=accuracy, lr=lr, loss=loss))
            bar.set_postfix(_postfix(steps, loss, accuracy, lr, (low, high)))
            if low <= accuracy <= high:
                break
            if accuracy < low:
                below = _snapshot(model, optim, accuracy, steps)
            else:
                if above is None or accuracy < above.accuracy:
                    above = _snapshot(model, optim, accuracy, steps)
                if below is None:
                    break  # above the band before any training: there is nothing to roll back to
                lr, eval_every, rollbacks = lr * LR_BACKOFF, 1, rollbacks + 1
                _restore(model, optim, below, lr)
                steps = below.steps
            if steps_total >= ws_cfg.max_steps:
                break
            model.train()
            for _ in range(min(eval_every, ws_cfg.max_steps - steps_total)):
                batch = demonstration_batch(
                    tokenizer, task, [task.sample(train_rng) for _ in range(ws_cfg.batch_size)]
                )
                loss_t = demonstration_loss(model, *(t.to(device) for t in batch))
                optim.zero_grad(set_to_none=True)
                loss_t.backward()
                optim.step()
                loss, steps, steps_total = loss_t.item(), steps + 1, steps_total + 1
                bar.set_postfix(_postfix(steps, loss, accuracy, lr, (low, high)), refresh=False)
                bar.update(1)
            model.eval()
    if not low <= accuracy <= high:
        if above is None:
            raise RuntimeError(
                f"warm start of {task!r} did not reach held-out accuracy {low} within warmstart.max_steps="
                f"{ws_cfg.max_steps} (last accuracy {accuracy:.3f} after {steps} steps); raise "
                "warmstart.max_steps or warmstart.lr, or lower warmstart.target_low"
            )
        _restore(model, optim, above, lr)
        accuracy, steps = above.accuracy, above.steps
        warnings.warn(
            f"warm start of {task!r} overshot the band [{low}, {high}] and ran out of warmstart.max_steps="
            f"{ws_cfg.max_steps}; using the closest model above the band (accuracy {accuracy:.3f})",
            RuntimeWarning,
            stacklevel=3,
        )
    return accuracy, steps, dict(steps_total=steps_total, rollbacks=rollbacks, history=history)
