"""Safe, verified checkpoints: everything a run needs to continue exactly where it stopped.

File format: `MAGIC` (8 bytes), the sha256 of the payload (32 bytes), then the payload, a `torch.save`
of a dict of tensors and plain Python values (RNG states included: numpy's key array is stored as a
tensor). Loading checks the magic and the checksum, then unpickles with `weights_only=True`, so a
crafted file can neither execute code nor pass a truncated or garbled payload off as a checkpoint.

The last two checkpoints are kept: `checkpoint.pt` and `checkpoint.prev.pt`. A write goes to
`.checkpoint.pt.tmp` (fsync'ed), the current checkpoint becomes the previous one, and the new one is
renamed into place; a kill at any moment leaves at least one complete, verified checkpoint. On a
corrupt latest checkpoint, `load_checkpoint` falls back to the previous one with a warning and moves
the corrupt file to `checkpoint.corrupt.pt`, so the next save keeps the good previous one.

Each checkpoint carries its run's id (`run_id`, moe_rl.trainer.folder); a resume given the folder's id
never loads a checkpoint of another run, not even as the fallback.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_rl.errors import RunError
from moe_rl.json_numbers import to_json

CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
CORRUPT = "checkpoint.corrupt.pt"
"""Where a corrupt checkpoint.pt is moved when a resume falls back past it, so the next save's rotation
cannot turn it into checkpoint.prev.pt over the one good copy."""
TMP = f".{CHECKPOINT}.tmp"
MAGIC = b"MOERLCK1"
"""First bytes of a checkpoint in this format (older ones are plain torch zip files, starting b"PK")."""


class CheckpointError(RunError):
    """No usable checkpoint where one was needed; the message is one line a user can act on."""


def rng_state(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    """The global RNGs' states and those of the named generators, as tensors and plain values only."""
    version, mt_state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "generators": {name: g.get_state() for name, g in generators.items()},
    }


def set_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    """Restore what `rng_state` captured."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["name"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, g in generators.items():
        g.set_state(state["generators"][name])


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> Path:
    """Write `state` as run_dir/checkpoint.pt, keeping the one before as checkpoint.prev.pt.

    The payload is serialised in memory first, so a state that cannot be saved (or a full disk) fails
    before the current checkpoint is touched.
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path, tmp = run_dir / CHECKPOINT, run_dir / TMP
    try:
        with tmp.open("wb") as f:
            f.write(MAGIC + hashlib.sha256(payload).digest())
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if path.exists():
        os.replace(path, run_dir / PREVIOUS)
    os.replace(tmp, path)
    return path


def read_checkpoint(path: Path) -> dict[str, Any]:
    """One checkpoint file, verified; CheckpointError (one line) when it is not a usable checkpoint."""
    data = path.read_bytes()
    if data[:2] == b"PK":
        raise CheckpointError(
            f"{path} is an old-format checkpoint (pickled RNG state), which cannot be loaded safely: "
            "start the run again without resume=true"
        )
    header = len(MAGIC) + 32
    if len(data) < header or data[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path} is not a moe-rl checkpoint (unknown header)")
    payload = data[header:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC) : header]:
        raise CheckpointError(f"{path} is corrupt (checksum mismatch: truncated or overwritten)")
    try:
        with warnings.catch_warnings():  # torch's "Detected pickle protocol ... please file an issue" before a refusal
            warnings.filterwarnings("ignore", message=r"Detected pickle protocol")
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - whatever the unpickler says, the file is unusable
        raise CheckpointError(f"{path} could not be loaded safely: {type(err).__name__}") from err
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{path} holds no training state")
    return state


def load_checkpoint(run_dir: Path, run_id: str | None = None) -> dict[str, Any] | None:
    """The run folder's newest usable checkpoint, or None when it has none.

    A corrupt checkpoint.pt falls back to checkpoint.prev.pt with a warning; when checkpoints exist but
    none is usable, CheckpointError names them. With `run_id`, a checkpoint recording another run's id
    is unusable (one written before run ids records none and is accepted). A stale temporary file of an interrupted write is removed,
    unless checkpoint.pt is missing and the file verifies (a kill between the renames): it becomes checkpoint.pt.
    """
    tmp = run_dir / TMP
    if tmp.exists() and not (run_dir / CHECKPOINT).exists():
        # Killed between save_checkpoint's two renames: the temporary file is the newest checkpoint, whole.
        with contextlib.suppress(CheckpointError):
            read_checkpoint(tmp)
            os.replace(tmp, run_dir / CHECKPOINT)
    tmp.unlink(missing_ok=True)
    errors = []
    for name in (CHECKPOINT, PREVIOUS):
        path = run_dir / name
        if not path.exists():
            continue
        try:
            state = read_checkpoint(path)
        except CheckpointError as err:
            errors.append(str(err))
            continue
        if run_id is not None and state.get("run_id") not in (None, run_id):
            errors.append(f"{path} belongs to another run (id {state['run_id']}, this folder's run is {run_id})")
            continue
        if errors:
            moved = ""
            with contextlib.suppress(OSError):  # a read-only folder: nothing will be saved over it either
                os.replace(run_dir / CHECKPOINT, run_dir / CORRUPT)
                moved = f" (the corrupt file is kept as {CORRUPT})"
            warnings.warn(
                f"{errors[0]}; resuming from the previous checkpoint {path} (step {state['step']}){moved}",
                RuntimeWarning,
                stacklevel=2,
            )
        return state
    if errors:
        raise CheckpointError(f"no usable checkpoint in {run_dir}: " + "; ".join(errors))
    return None


# --- resume -----------------------------------------------------------------------------------------

RESUME_SAFE = (
    "trainer.steps",
    "trainer.checkpoint_every",
    "trainer.threads",
    "rollout.sampler_threads",
    "trainer.dist_timeout_s",
    "warmstart.cache_dir",
    "model.tokenizer_cache_dir",  # where a BPE is kept; its content hash decides which one is read
    "resume",
    "resume_force",
    "overwrite",
    "logger.",
    "eval.",  # held-out evaluation never changes training (moe_rl.trainer.evaluate)
    "trainer.export_hf",
)
"""Config fields (or prefixes, ending in ".") that may change on resume: none changes the numbers."""

HYDRA_FILES = ("config.yaml", "overrides.yaml", "hydra.yaml")
"""Hydra's record of a run (`.hydra/`), kept in each checkpoint: Hydra rewrites it before a resumed job
starts, so a refused or no-op resume puts the original back."""


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_diff(saved: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[str]:
    """Dotted names of the fields, outside RESUME_SAFE, whose values differ between two configs.

    A field the saved config lacks (added to the schema after the checkpoint was written) is no change
    when the current value is its schema default in `defaults`: a new field defaults to the old behaviour.
    """
    a, b, d = _flatten(saved), _flatten(current), _flatten(defaults or {})
    safe = tuple(RESUME_SAFE)
    return sorted(
        k
        for k in set(a) | set(b)
        if not (k in safe or k.startswith(safe))
        and a.get(k) != b.get(k)
        and not (k not in a and k in d and b.get(k) == d[k])
    )


def shown_diff(diff: list[str], saved: dict[str, Any], current: dict[str, Any]) -> str:
    """The fields of `diff` with their saved and current values, for a one-line refusal."""
    a, b = _flatten(saved), _flatten(current)
    return ", ".join(f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in diff)


def hydra_files(run_dir: Path) -> dict[str, str]:
    """The run folder's `.hydra/*.yaml` texts (empty outside Hydra)."""
    folder = run_dir / ".hydra"
    return {name: (folder / name).read_text() for name in HYDRA_FILES if (folder / name).is_file()}


def restore_hydra_files(run_dir: Path, files: dict[str, str]) -> None:
    """Put back what `hydra_files` recorded (or write the entry point's record of a new run)."""
    if files:
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (run_dir / ".hydra" / name).write_text(text)


def resume_state(
    run_dir: Path,
    config: dict[str, Any],
    *,
    force: bool,
    defaults: dict[str, Any] | None = None,
    run_id: str | None = None,
) -> dict[str, Any] | None:
    """The checkpoint of run `run_id` (any, if None) to resume from, or None when the folder has none (the
    caller says what it does then: a finished run is left as it is, an unfinished one starts fresh).

    Raises CheckpointError when the folder's checkpoints are unusable, and RunError when the
    checkpoint's config differs from `config` outside RESUME_SAFE (unless `force`).
    """
    state = load_checkpoint(run_dir, run_id)
    if state is None:
        return None
    diff = config_diff(state["config"], config, defaults)
    if diff and not force:
        restore_hydra_files(run_dir, state.get("hydra", {}))
        shown = shown_diff(diff, state["config"], config)
        raise RunError(
            f"resume=true refused: the config differs from the checkpoint's in {shown}; "
            "resume with the run's own config, or add resume_force=true to continue anyway"
        )
    if diff:
        warnings.warn(f"resume_force=true: resuming with changed fields {', '.join(diff)}", RuntimeWarning, stacklevel=2)
    return state


def finished_without_checkpoint(
    run_dir: Path,
    config: dict[str, Any],
    steps: int,
    *,
    force: bool,
    defaults: dict[str, Any] | None = None,
    run_id: str | None = None,
) -> dict[str, Any] | None:
    """The summary.json of a run of id `run_id` (any, if None) that finished (all `steps` done, or stopped
    on collapse) but whose checkpoints are gone: deleted to save disk, or a run unpacked from an archive
    (moe-rl-archive). Resuming it has nothing to do. None when the folder holds no such run.

    The summary's recorded config stands in for the checkpoint's: a difference outside RESUME_SAFE is
    refused (RunError) unless `force`, and so is a summary that records no config (one written before
    summaries did), since nothing then tells whether it is this config's run.
    """
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if run_id is not None and summary.get("run_id") != run_id:
        return None
    if not (summary.get("steps_done", -1) >= steps or summary.get("stopped_on_collapse")):
        return None
    recorded = summary.get("config")
    if recorded is None:
        raise RunError(
            f"resume=true refused: {run_dir} holds a finished run without checkpoints whose summary.json records "
            "no config to check this one against; add overwrite=true to move it aside and run again"
        )
    diff = config_diff(recorded, json.loads(to_json(config)), json.loads(to_json(defaults or {})))
    if diff and not force:
        shown = shown_diff(diff, recorded, config)
        raise RunError(
            f"resume=true refused: the config differs from that of the finished run in {run_dir} in {shown}; "
            "resume with the run's own config, or add resume_force=true to accept it anyway"
        )
    return summary


def finished_summary(run_dir: Path, state: dict[str, Any], steps: int) -> dict[str, Any] | None:
    """The run's summary.json if the run already ended at the checkpoint's step (all `steps` done, or
    stopped on collapse): resuming it has nothing to do. None otherwise."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if summary.get("steps_done") != state["step"]:
        return None
    if state["step"] >= steps or summary.get("stopped_on_collapse"):
        return summary
    return None
