"""Checks of a loaded dataset task against the rest of the run's config (`Config.load_task`).

Kept apart from `moe_rl.tasks.dataset`, which knows only `task.*`: these read eval, the warm start, the
sampler and the model's tokenizer too. Each failure is a ValueError naming the field to change.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl.models.tokenizer import policy_tokenizer
from moe_rl.tasks.dataset import WARMSTART_PROBE_ROWS, DatasetTask
from moe_rl.warmstart import answer_ids

if TYPE_CHECKING:
    from moe_rl.config import Config


def check_dataset_run(task: DatasetTask, cfg: Config) -> None:
    """Enough held-out rows for eval (or, under eval.fit_heldout, a note that eval uses all of them) and the
    warm start; prompts that fit the model (check_prompt_lengths); with the warm start on, answers the reward gives
    full marks as responses (they are its demonstrations), and a warning when some are longer than the
    sampler can write (a model built from config: its tokenizer is known here)."""
    held = len(task.heldout_rows)
    fitted = cfg.eval.fitted(held)
    if fitted != cfg.eval:
        warnings.warn(
            f"task.heldout={cfg.task.heldout} holds out {held} of {cfg.task.path}'s {len(task.rows)} rows, fewer than "
            f"eval.size={cfg.eval.size} / eval.expected_size={cfg.eval.expected_size}: evaluating on all {held} "
            "(eval.fit_heldout=true; raise task.heldout for more)",
            RuntimeWarning,
            stacklevel=3,
        )
    needs = {
        "eval.size / eval.expected_size": fitted.prompts_needed,
        "warmstart.eval_size": cfg.warmstart.eval_size if cfg.warmstart.enabled else 0,
    }
    for name, n in needs.items():
        if n > held:
            raise ValueError(
                f"{name}: {n} held-out rows are needed, but task.heldout={cfg.task.heldout} holds out {held} "
                f"of {cfg.task.path}'s {len(task.rows)} rows: lower {name.split(' ')[0]} or raise task.heldout"
            )
    check_prompt_lengths(task, cfg)
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


def check_prompt_lengths(task: DatasetTask, cfg: Config) -> None:
    """Every prompt's tokens plus sampler.max_new_tokens must fit the model's positions; ValueError naming the
    longest row (else the first forward fails with a giant allocation). Checked for a model built from config
    (model.max_position_embeddings, its own tokenizer) and for a local model.pretrained folder (its
    config.json and tokenizer); a hub id is not fetched for it. task.max_prompt_tokens is applied first,
    with the same tokenizer (`_cap_prompts`)."""
    if cfg.model.pretrained:
        folder = Path(cfg.model.pretrained).expanduser()
        if not (folder / "config.json").is_file():
            return
        from transformers import AutoTokenizer

        limit = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
        tokenizer, where = AutoTokenizer.from_pretrained(str(folder)), f"{folder}'s max_position_embeddings"
    else:
        tokenizer, limit = policy_tokenizer(cfg.model, task), cfg.model.max_position_embeddings
        where = "model.max_position_embeddings"
    if cfg.task.max_prompt_tokens is not None:
        _cap_prompts(task, tokenizer, cfg.task.max_prompt_tokens, cfg.task.prompt_overflow)
    if not isinstance(limit, int):
        return
    room = limit - cfg.sampler.max_new_tokens
    # A character is at most 4 tokens (byte-level BPE on a 4-byte UTF-8 character), plus a few special tokens:
    # only prompts that could overflow are tokenized.
    suspects = [r for r, text in enumerate(task.prompts) if 4 * len(text) + 8 > room]
    lengths = {r: len(tokenizer(task.prompts[r]).input_ids) for r in suspects}
    over = [r for r, n in lengths.items() if n > room]
    if over:
        longest = max(over, key=lengths.__getitem__)
        raise ValueError(
            f"task.path={cfg.task.path}: {len(over)} of {len(task.prompts)} prompts do not fit the model: row "
            f"{longest}'s prompt is {lengths[longest]} tokens, and with sampler.max_new_tokens="
            f"{cfg.sampler.max_new_tokens} that is {lengths[longest] + cfg.sampler.max_new_tokens} positions, "
            f"more than {where}={limit}: shorten or drop those rows, or lower sampler.max_new_tokens"
        )


def _cap_prompts(task: DatasetTask, tokenizer, cap: int, overflow: str) -> None:
    """task.max_prompt_tokens: refuse the prompts over `cap` tokens (naming the longest) or cut them to their
    first `cap` tokens, decoded back to text, in place (a warning counts them)."""
    suspects = [r for r, text in enumerate(task.prompts) if 4 * len(text) + 8 > cap]
    ids = {r: tokenizer(task.prompts[r], add_special_tokens=False).input_ids for r in suspects}
    over = [r for r, tokens in ids.items() if len(tokens) > cap]
    if not over:
        return
    longest = max(over, key=lambda r: len(ids[r]))
    if overflow == "refuse":
        raise ValueError(
            f"task.max_prompt_tokens={cap}: {len(over)} of {len(task.prompts)} prompts of {task.cfg.path} are "
            f"longer (row {longest}: {len(ids[longest])} tokens): drop or shorten them, raise the limit, or set "
            "task.prompt_overflow=truncate"
        )
    for r in over:
        task.prompts[r] = tokenizer.decode(ids[r][:cap])
    warnings.warn(
        f"task.max_prompt_tokens={cap}: cut {len(over)} of {len(task.prompts)} prompts of {task.cfg.path} to their "
        f"first {cap} tokens (the longest, row {longest}, had {len(ids[longest])})",
        RuntimeWarning,
        stacklevel=3,
    )
