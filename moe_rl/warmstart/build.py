"""`warm_start`: a verified cache entry for the configuration, or one built under the entry's lock, trained
on BUILD_THREADS threads from a forked RNG, saved into a temporary folder and renamed into place."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from moe_rl.errors import RunError
from moe_rl.json_numbers import jsonable
from moe_rl.models import ModelConfig, build_model
from moe_rl.models.tokenizer import policy_tokenizer
from moe_rl.tasks import Task, make_task
from moe_rl.warmstart.cache import (
    acquire_lock,
    cache_key,
    checksums,
    task_identity,
    verified_meta,
    warm_start_dir,
)
from moe_rl.warmstart.config import BUILD_THREADS, FORMAT_VERSION, META_FILE, WarmStartConfig, WarmStartResult
from moe_rl.warmstart.pretrain import pretrain
from moe_rl.warmstart.search import band_search


@contextlib.contextmanager
def _hf_progress_bars(enabled: bool) -> Iterator[None]:
    """Silence transformers' own progress bars (e.g. "Writing model shards") when progress=False."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_entry(
    final: Path,
    model_cfg: ModelConfig,
    task_name: str,
    difficulty: int,
    ws_cfg: WarmStartConfig,
    seed: int,
    max_new_tokens: int,
    key: str,
    device: str,
    progress: bool,
    mix: Sequence[int],
    task: Task,
) -> tuple[float, int]:
    """Train, then save into a temporary sibling of `final` and rename it into place; return (accuracy, steps)."""
    start = time.perf_counter()
    if model_cfg.pretrained:
        tokenizer = AutoTokenizer.from_pretrained(model_cfg.pretrained)
    else:
        tokenizer = policy_tokenizer(model_cfg, task)
    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            model = build_model(model_cfg, tokenizer).to(device)
            pre_stats = {}
            if ws_cfg.pretrain_steps > 0:
                pre_stats = pretrain(model, tokenizer, ws_cfg, seed, progress)
            accuracy, steps, stats = band_search(model, tokenizer, task, ws_cfg, seed, max_new_tokens, progress)
            stats.update(pre_stats)
    finally:
        torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        with _hf_progress_bars(progress):
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = dict(
            format=FORMAT_VERSION,
            key=key,
            accuracy=accuracy,
            steps=steps,
            seconds=time.perf_counter() - start,
            task=task_name,
            difficulty=difficulty,
            mix=list(mix),
            data=task_identity(task),
            seed=seed,
            max_new_tokens=max_new_tokens,
            model=asdict(model_cfg),
            warmstart=asdict(ws_cfg),
            device=torch.device(device).type,
            build_threads=BUILD_THREADS,
            sha256=checksums(tmp),
            **stats,
        )
        # Strict JSON (the first history entry's loss, before any step, is NaN: written "nan", as every run file)
        (tmp / META_FILE).write_text(json.dumps(jsonable(meta), indent=2, allow_nan=False))
        os.replace(tmp, final)  # atomic: the final name never holds a half-written directory
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return accuracy, steps


def warm_start(
    model_cfg: ModelConfig,
    task_name: str,
    difficulty: int,
    ws_cfg: WarmStartConfig,
    seed: int,
    *,
    max_new_tokens: int | None = None,
    progress: bool = True,
    device: str = "cpu",
    mix: Sequence[int] = (),
    task: Task | None = None,
) -> WarmStartResult:
    """Return a cached warm-started checkpoint for this configuration, training it first if needed.

    max_new_tokens: response limit of the accuracy check; default `task.max_response_len + 1` (EOS).
    Pass the RL sampler's value so the band is measured as RL will sample.
    device: where training runs; its type (cpu, cuda) is part of the cache key.
    mix: task.mix, the difficulties examples are drawn at (empty: `difficulty` only); part of the key.
    task: the built task (a `DatasetTask`, whose rows and settings enter the key); default
    `make_task(task_name, difficulty, mix)`.
    Raises ValueError for a bad config and RuntimeError when accuracy never reaches target_low.
    """
    start = time.perf_counter()
    ws_cfg.validate()
    model_cfg.validate()
    if not ws_cfg.enabled:
        raise ValueError("warmstart.enabled=false: the caller should skip the warm start")
    if seed < 0:
        raise ValueError(
            f"seed={seed}: the run seed must be >= 0 (it seeds the train split's example stream)"
        )
    task = task if task is not None else make_task(task_name, difficulty, mix)
    if max_new_tokens is None:
        max_new_tokens = task.max_response_len + 1
    final = warm_start_dir(
        model_cfg, task_name, difficulty, ws_cfg, seed, max_new_tokens=max_new_tokens, device=device, mix=mix,
        task=task,
    )
    # A finished entry never changes: a valid one is read without the lock (a read-only cache works).
    meta = verified_meta(final)
    if meta is not None:
        return WarmStartResult(str(final), meta["accuracy"], meta["steps"], True, time.perf_counter() - start)
    lock_path = Path(f"{final}.lock")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = acquire_lock(lock_path)
    except OSError as err:
        raise RunError(
            f"warm-start cache {final.parent} is not writable ({err.strerror or err}) and holds no valid "
            "entry for this config: set warmstart.cache_dir to a writable folder"
        ) from err
    try:
        meta = verified_meta(final, warn=True)  # another process may have built it while we waited
        cached = meta is not None
        if cached:
            accuracy, steps = meta["accuracy"], meta["steps"]
        else:
            # Holding the lock, no one else builds this key: leftovers are from a crashed builder.
            for stale in final.parent.glob(f".{final.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():
                shutil.rmtree(final)
            key = cache_key(
                model_cfg, task_name, difficulty, ws_cfg, seed, max_new_tokens, device=device, mix=mix,
                data=task_identity(task),
            )
            try:
                accuracy, steps = build_entry(
                    final, model_cfg, task_name, difficulty, ws_cfg, seed, max_new_tokens, key, device,
                    progress, mix, task,
                )
            except BaseException:
                lock_path.unlink(missing_ok=True)  # no entry: leave no lock file behind either
                raise
    finally:
        lock.release()
    return WarmStartResult(str(final), accuracy, steps, cached, time.perf_counter() - start)
