"""Atomic checkpoints: everything a run needs to continue exactly where it stopped."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT = "checkpoint.pt"


def rng_state(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    """The global RNGs' states and those of the named generators."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "generators": {name: g.get_state() for name, g in generators.items()},
    }


def set_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    """Restore what `rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, g in generators.items():
        g.set_state(state["generators"][name])


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> Path:
    """Write `state` to run_dir/checkpoint.pt atomically (temp file, fsync, rename)."""
    path = run_dir / CHECKPOINT
    tmp = run_dir / f".{CHECKPOINT}.tmp"
    with tmp.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The run folder's checkpoint, or None when it has none."""
    path = run_dir / CHECKPOINT
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
