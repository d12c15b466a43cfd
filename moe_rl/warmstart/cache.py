"""The warm-start cache: a key of everything that determines the weights, an entry folder per key, the
checksums that verify an entry, and the exclusive lock builders take (moe_rl.warmstart's docstring)."""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from moe_rl.models.config import ModelConfig
from moe_rl.tasks import DatasetTask, Task, make_task
from moe_rl.warmstart.config import FORMAT_VERSION, META_FILE, WarmStartConfig


def cache_key(
    model_cfg: ModelConfig,
    task_name: str,
    difficulty: int,
    ws_cfg: WarmStartConfig,
    seed: int,
    max_new_tokens: int,
    *,
    device: str = "cpu",
    mix: Sequence[int] = (),
    data: dict[str, Any] | None = None,
) -> str:
    """sha256 hex digest of a canonical JSON of everything that determines the warm-started weights.

    The device type (cpu, cuda) is part of it: kernels differ, so do the weights. The thread count is
    not: builds run on BUILD_THREADS threads whatever the caller's setting. A non-empty `mix` (task.mix,
    order and repeats included: both change the draws) is; an empty one adds nothing, so the keys of
    single-difficulty entries are those they had before task.mix existed. Likewise the pretraining fields
    enter only when `pretrain_steps` > 0, the model's tokenizer fields only when it is not char, and
    `data` (a dataset task's `identity()`: its rows' hash and the settings that shape them) only when given.
    """
    ws = asdict(ws_cfg)
    del ws["cache_dir"], ws["build_seed"]  # where it is kept; which seed builds it is `seed` below
    if ws_cfg.pretrain_steps == 0:  # no pretraining: the keys entries had before it existed
        del ws["pretrain_steps"], ws["pretrain_aux_loss_coef"]
    model = asdict(model_cfg)
    del model["tokenizer_cache_dir"], model["router_dtype"]  # where it is kept; RL only (precision.py)
    if model_cfg.tokenizer == "char":  # the tokenizer every entry had before model.tokenizer existed
        del model["tokenizer"], model["bpe_vocab_size"]
    payload = dict(
        format=FORMAT_VERSION,
        device=torch.device(device).type,
        model=model,
        task=task_name,
        difficulty=difficulty,
        warmstart=ws,
        seed=seed,
        max_new_tokens=max_new_tokens,
        **({"mix": list(mix)} if mix else {}),
        **({"data": data} if data is not None else {}),
    )
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def task_identity(task: Task) -> dict[str, Any] | None:
    """A dataset task's part of the cache key (its rows and settings); None for a synthetic task."""
    return task.identity() if isinstance(task, DatasetTask) else None


def warm_start_dir(
    model_cfg: ModelConfig,
    task_name: str,
    difficulty: int,
    ws_cfg: WarmStartConfig,
    seed: int,
    *,
    max_new_tokens: int | None = None,
    device: str = "cpu",
    mix: Sequence[int] = (),
    task: Task | None = None,
) -> Path:
    """The cache directory `<cache_dir>/<task>-<key[:16]>` of a warm start (its lock is `<dir>.lock`)."""
    task = task if task is not None else make_task(task_name, difficulty, mix)
    if max_new_tokens is None:
        max_new_tokens = task.max_response_len + 1
    key = cache_key(model_cfg, task_name, difficulty, ws_cfg, seed, max_new_tokens, device=device, mix=mix,
                    data=task_identity(task))
    return Path(ws_cfg.cache_dir).expanduser().resolve() / f"{task_name}-{key[:16]}"


def checksums(folder: Path) -> dict[str, str]:
    """sha256 of every file of an entry except warmstart.json, by name."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != META_FILE
    }


def verified_meta(final: Path, warn: bool = False) -> dict[str, Any] | None:
    """The entry's warmstart.json if the entry is complete and every file matches its checksum; else None
    (with `warn`, a warning that a corrupt entry will be rebuilt)."""
    if not final.is_dir():
        return None
    try:
        meta = json.loads((final / META_FILE).read_text())
        ok = meta.get("format") == FORMAT_VERSION and meta["sha256"] == checksums(final)
        ok = ok and isinstance(meta["accuracy"], float | int) and isinstance(meta["steps"], int)
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if ok:
        return meta
    if warn:
        warnings.warn(f"warm-start cache entry {final} is corrupt or incomplete: rebuilding it", RuntimeWarning, stacklevel=3)
    return None


def acquire_lock(lock_path: Path) -> FileLock:
    """An exclusive lock on `lock_path` (released by the OS if the process dies). A lock file removed by
    a failed builder while we waited is a stale lock: take a fresh one."""
    while True:
        lock = FileLock(lock_path)
        lock.acquire()
        if lock_path.exists():
            return lock
        lock.release()
