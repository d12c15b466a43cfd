"""Checks of a loaded dataset task against the rest of the run's config (`Config.load_task`).

Kept apart from `moe_rl.tasks.dataset`, which knows only `task.*`: these read eval, the warm start, the
sampler and the model's tokenizer too. Each failure is a ValueError naming the field to change.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from moe_rl.models.tokenizer import policy_tokenizer
from moe_rl.tasks.dataset import WARMSTART_PROBE_ROWS, DatasetTask
from moe_rl.warmstart import answer_ids

if TYPE_CHECKING:
    from moe_rl.config import Config


def check_dataset_run(task: DatasetTask, cfg: Config) -> None:
    """Enough held-out rows for eval and the warm start; with the warm start on, answers the reward gives
    full marks as responses (they are its demonstrations), and a warning when some are longer than the
    sampler can write (a model built from config: its tokenizer is known here)."""
    held = len(task.heldout_rows)
    needs = {
        "eval.size / eval.expected_size": cfg.eval.prompts_needed,
        "warmstart.eval_size": cfg.warmstart.eval_size if cfg.warmstart.enabled else 0,
    }
    for name, n in needs.items():
        if n > held:
            raise ValueError(
                f"{name}: {n} held-out rows are needed, but task.heldout={cfg.task.heldout} holds out {held} "
                f"of {cfg.task.path}'s {len(task.rows)} rows: lower {name.split(' ')[0]} or raise task.heldout"
            )
    if not cfg.warmstart.enabled:
        return
    rows = task.train_rows[:WARMSTART_PROBE_ROWS]
    scores, _ = task.rewards([task.row_example(r) for r in rows], [task.answers[r] for r in rows])
    bad = [(r, v) for r, v in zip(rows, scores, strict=True) if v != 1.0]
    if bad:
        row, value = bad[0]
        raise ValueError(
            f"warmstart.enabled=true trains on task.answer_field as the response, but it scores {value} "
            f"as a response on row {row} ({task.answers[row][:60]!r}): the answers are not full responses "
            "the reward accepts; set warmstart.enabled=false"
        )
    if cfg.model.pretrained:
        return
    tokenizer = policy_tokenizer(cfg.model, task)
    lengths = [len(answer_ids(tokenizer, task, task.row_example(r))) for r in task.train_rows]
    over = sum(n > cfg.sampler.max_new_tokens for n in lengths)
    if over:
        warnings.warn(
            f"{over} of {len(lengths)} training answers are longer than sampler.max_new_tokens="
            f"{cfg.sampler.max_new_tokens} tokens (the longest: {max(lengths)} with EOS): the warm start "
            "imitates them, but the sampler cuts them off",
            RuntimeWarning,
            stacklevel=3,
        )
