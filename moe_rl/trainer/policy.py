"""The initial policy of a run and its tokenizer: warm-started (cached) when enabled, else loaded from
`model.pretrained` or freshly built (moe_rl.models)."""

from __future__ import annotations

import dataclasses

from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from moe_rl.config import Config
from moe_rl.models import build_model
from moe_rl.models.build import unloadable
from moe_rl.models.tokenizer import policy_tokenizer
from moe_rl.startup import load_task
from moe_rl.tasks import Task
from moe_rl.warmstart import WarmStartResult, warm_start


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """A saved tokenizer, set up for batched sampling: left padding, and EOS as the pad token when it has
    none (Mixtral's): the sampler masks everything after a response's first EOS."""
    with unloadable(path, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def initial_policy(cfg: Config, progress: bool,
                   task: Task | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, WarmStartResult | None]:
    """The initial policy for `task` (default `moe_rl.startup.load_task(cfg)`): warm-started (cached) when
    enabled, else freshly built or loaded."""
    task = task if task is not None else load_task(cfg)
    if not cfg.warmstart.enabled:
        tokenizer = load_tokenizer(cfg.model.pretrained) if cfg.model.pretrained else policy_tokenizer(cfg.model, task)
        return build_model(cfg.model, tokenizer), tokenizer, None
    ws = warm_start(
        cfg.model,
        cfg.task.name,
        cfg.task.difficulty,
        cfg.warmstart,
        cfg.seed if cfg.warmstart.build_seed is None else cfg.warmstart.build_seed,
        mix=cfg.task.mix,
        max_new_tokens=cfg.sampler.max_new_tokens,
        progress=progress,
        device=cfg.trainer.device,
        task=task,
    )
    # A cache entry that verifies but does not load (a planted file with matching checksums) is named as
    # the cache entry, not as model.pretrained, which the user never set.
    where = f"the warm-start cache entry {ws.path} (delete it to rebuild it)"
    model = build_model(dataclasses.replace(cfg.model, pretrained=str(ws.path)), where=where)
    with unloadable(str(ws.path), "tokenizer", where):
        tokenizer = AutoTokenizer.from_pretrained(ws.path)
    return model, tokenizer, ws
