"""Refuse a pre-registered sweep's blind run unless its pre-registration came first (issue 57).

    python experiments/lib/preregistration.py check PREREG SWEEP_DIR MANIFEST

Exits 0 when PREREG is a file committed in this repository, unchanged since, and its first commit is older
than every record of the sweep: every archive MANIFEST lists (the study's records.json, moe_rl.records; each
archive named by its UTC pack time, `YYYYmmddTHHMMSSZ.tar.xz`) and every run's `metrics.jsonl` under SWEEP_DIR (by modification time; runs
unpacked from archives carry the time they were unpacked, after the commit). Else prints one line saying
which and exits 1.
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from moe_rl.records import read_manifest


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False).stdout.strip()


def problem(prereg: Path, sweep: Path, records: Path) -> str | None:
    """Why the blind run must not start, or None."""
    if not prereg.is_file():
        return f"{prereg}: no pre-registration; commit it before the sweep's first run"
    root = Path(_git(prereg.parent, "rev-parse", "--show-toplevel") or prereg.parent)
    rel = str(prereg.resolve().relative_to(root.resolve()))
    added = _git(root, "log", "--diff-filter=A", "--format=%ct", "--", rel).splitlines()
    if not added:
        return f"{prereg}: not committed; commit the pre-registration before the sweep's first run"
    if _git(root, "status", "--porcelain", "--", rel):
        return f"{prereg}: changed since its commit; commit a dated amendment before running"
    committed = int(added[-1])
    stamps = []
    for archive in [entry.file for entry in read_manifest(records)]:
        try:
            stamps.append(datetime.strptime(archive[:16], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).timestamp())
        except ValueError:
            return f"{archive}: not a sittings archive name (YYYYmmddTHHMMSSZ.tar.xz)"
    stamps += [p.stat().st_mtime for p in sweep.rglob("metrics.jsonl")] if sweep.is_dir() else []
    if stamps and min(stamps) < committed:
        first = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(min(stamps)))
        return (f"{prereg}: first committed {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(committed))} UTC, after "
                f"the sweep's first record ({first} UTC): the study is not pre-registered")
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4 or args[0] != "check":
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    why = problem(Path(args[1]), Path(args[2]), Path(args[3]))
    if why:
        print(f"preregistration: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
