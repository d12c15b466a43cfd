"""Carry a sweep's finished runs from one sitting to the next: pack their records into one compressed file,
and unpack them into the sweep folder of a later sitting, on a machine that kept nothing.

    moe-rl-archive pack multirun/confirm_sort_long records/sitting1.tar.xz --skip records/*.tar.xz
    moe-rl-archive unpack records/*.tar.xz --into multirun/confirm_sort_long

- **What a record is.** Of each finished run folder (summary.json and metrics.jsonl, the folders
  moe-rl-analyze reads), the files in RECORD: its metrics, events, summary (with the run's config), run id
  and Hydra's config and overrides. Not its checkpoints, exported policy or W&B folder: a record is what analysis and a
  resume of the finished run need, about 0.1 MB compressed for 200 steps. Paths are kept relative to the
  sweep folder, so a record unpacks where its run was.
- **Nothing is replaced.** `pack` refuses an output that exists; `unpack` refuses, before it writes
  anything, a file that exists with other bytes (equal ones are skipped), and any member outside the
  folder. A run already in a `--skip` archive is left out of a new one, so each sitting adds its own.
- **Untrusted input is bounded.** `unpack` refuses, before it writes anything, a member larger than
  `--max-member-mb` (64 by default; a record is about 0.1 MB) or archives that would write more than
  `--max-total-mb` (1024) in all, a member whose name normalises to a folder (`run0/.`), and a destination
  reached through a symbolic link or through a path component that is a file. It streams each member in
  chunks, twice (a hash to compare, then the write), and never holds one in memory.
- **A sweep over unpacked runs leaves them as they are.** `resume=true` finds a finished run without
  checkpoints and returns its summary, once its recorded config matches the job's
  (moe_rl.trainer.checkpoint.finished_without_checkpoint); the unfinished jobs run.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import shutil
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from moe_rl import records
from moe_rl.errors import RunError, one_line
from moe_rl.records import archived_runs
from moe_rl.trainer.folder import set_aside

RECORD = ("metrics.jsonl", "events.jsonl", "summary.json", "run_id.txt", ".hydra/config.yaml",
          ".hydra/overrides.yaml")  # fmt: skip
"""The files of a finished run folder that an archive keeps, those present. Not Hydra's hydra.yaml, which
holds the machine's folders; in summary.json the home folder is written `~`."""


def finished_runs(sweep: Path) -> list[Path]:
    """Run folders under `sweep` (recursively, or `sweep` itself) holding summary.json and metrics.jsonl,
    outside Hydra's records and folders moved aside by overwrite=true, relative to `sweep`, sorted."""
    if not sweep.is_dir():
        raise RunError(f"{sweep}: no such folder")
    found = []
    for summary in sweep.rglob("summary.json"):
        rel = summary.parent.relative_to(sweep)
        if not set_aside(rel) and (summary.parent / "metrics.jsonl").is_file():
            found.append(rel)
    return sorted(found)


def pack(sweep: Path, out: Path, skip: Sequence[Path] = ()) -> list[PurePosixPath]:
    """Write the records of `sweep`'s finished runs, except those in the `skip` archives, to `out`
    (.tar.xz); returns the runs packed, [] (and writes nothing) when none is new. RunError if `out` exists."""
    if out.exists():
        raise RunError(f"{out} exists: give the archive a new name (an archive is never replaced)")
    done = archived_runs(p for p in skip if p.resolve() != out.resolve())
    runs = [PurePosixPath(r.as_posix()) for r in finished_runs(sweep)]
    new = [r for r in runs if r not in done]
    if not new:
        return []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:xz") as tar:
        for run in new:
            for name in RECORD:
                path = sweep / run / name
                if path.is_file():
                    info = tarfile.TarInfo(str(run / name))
                    data = record_bytes(name, path.read_bytes())
                    info.size, info.mtime, info.mode = len(data), int(path.stat().st_mtime), 0o644
                    tar.addfile(info, io.BytesIO(data))
    tmp.replace(out)
    return new


def record_bytes(name: str, data: bytes) -> bytes:
    """A record file's bytes as archived: in summary.json (the warm start's path) the home folder is `~`."""
    return data.replace(str(Path.home()).encode(), b"~") if name == "summary.json" else data


MAX_MEMBER_MB = 64
MAX_TOTAL_MB = 1024
CHUNK = 1 << 20


def _safe_name(name: str, archive: Path) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise RunError(f"{archive}: member {name!r} lies outside the folder it unpacks into: refused")
    if any(part in ("", ".") for part in name.split("/")):
        raise RunError(f"{archive}: member {name!r} names a folder, not a file: refused")
    return path


def _digest(stream) -> str:
    return hashlib.file_digest(stream, "sha256").hexdigest()


def _file_digest(path: Path) -> str:
    """sha256 of a file already in the folder, as archived (record_bytes: summary.json's home folder as ~)."""
    if path.name == "summary.json":  # small, and compared as pack would write it
        return hashlib.sha256(record_bytes(path.name, path.read_bytes())).hexdigest()
    return records.sha256(path)


def _check_path(into: Path, dest: Path) -> None:
    """RunError when a component of `dest` below `into` is a symbolic link, or a file where a folder must be."""
    here = into
    parts = dest.relative_to(into).parts
    for i, part in enumerate(parts):
        here = here / part
        if here.is_symlink():
            raise RunError(f"{here} is a symbolic link: nothing unpacked through it")
        if i < len(parts) - 1 and here.exists() and not here.is_dir():
            raise RunError(f"{here} is a file where {dest} needs a folder: nothing unpacked")


def unpack(archives: Sequence[Path], into: Path, max_member_mb: float = MAX_MEMBER_MB,
           max_total_mb: float = MAX_TOTAL_MB) -> tuple[int, int]:
    """Extract `archives` into `into`; returns (files written, files already there with the same bytes).
    RunError, before anything is written, for a member that is not a plain file inside `into`, one larger
    than `max_member_mb`, archives over `max_total_mb` in all, a destination holding other bytes or reached
    through a symbolic link or a file. Members are streamed, never read whole."""
    plan: dict[Path, tuple[str, Path, str]] = {}  # dest -> (digest, archive, member name)
    total = 0.0
    for archive in archives:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                if member.isdir():
                    continue
                rel = _safe_name(member.name, archive)
                if not member.isfile():
                    raise RunError(f"{archive}: member {member.name!r} is not a plain file: refused")
                size_mb = member.size / 1e6
                if size_mb > max_member_mb:
                    raise RunError(f"{archive}: member {member.name!r} is {size_mb:.1f} MB, over --max-member-mb="
                                   f"{max_member_mb:g} (a run record is about 0.1 MB): nothing unpacked")
                total += size_mb
                if total > max_total_mb:
                    raise RunError(f"{archive}: the archives hold over --max-total-mb={max_total_mb:g} MB: "
                                   "nothing unpacked")
                dest = into / rel
                digest = _digest(tar.extractfile(member))
                if plan.get(dest, (digest,))[0] != digest:
                    raise RunError(f"{dest}: two archives hold different bytes for it: nothing unpacked")
                plan[dest] = (digest, archive, member.name)
    for dest in plan:
        _check_path(into, dest)
    clashes = [d for d, (digest, _, _) in plan.items() if d.exists() and _file_digest(d) != digest]
    if clashes:
        raise RunError(f"{clashes[0]} exists with other bytes ({len(clashes)} file(s) in all): nothing unpacked; "
                       "unpack into another folder")
    todo = {d: v for d, v in plan.items() if not d.exists()}
    written = len(todo)
    for archive in archives:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                dest = into / member.name if member.isfile() else None
                if dest not in todo or todo[dest][1] != archive or todo[dest][2] != member.name:
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(dest.name + ".unpacking")
                with tar.extractfile(member) as src, tmp.open("wb") as out:
                    shutil.copyfileobj(src, out, CHUNK)
                tmp.replace(dest)
                del todo[dest]
    assert not todo, f"members not found again on the second pass: {sorted(todo)[:3]}"
    return written, len(plan) - written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-rl-archive", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="pack the records of a sweep's finished runs into a new .tar.xz")
    p.add_argument("sweep", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--skip", type=Path, nargs="*", default=[], help="archives whose runs are left out")
    u = sub.add_parser("unpack", help="unpack archives into a sweep folder, replacing nothing")
    u.add_argument("archives", type=Path, nargs="+")
    u.add_argument("--into", type=Path, required=True)
    u.add_argument("--max-member-mb", type=float, default=MAX_MEMBER_MB, help="refuse a larger member (default 64)")
    u.add_argument("--max-total-mb", type=float, default=MAX_TOTAL_MB, help="refuse more in all (default 1024)")
    f = sub.add_parser("fetch", help="bring a study's archives back from the sources its manifest lists, verified")
    f.add_argument("manifest", type=Path, help="docs/results/NAME/records.json")
    f.add_argument("--out", type=Path, help="folder for the archives (default records/NAME)")
    f.add_argument("--into", type=Path, help="also unpack them into this sweep folder")
    s = sub.add_parser("publish", help="add archives to a study's manifest, with the sources they can be fetched from")
    s.add_argument("manifest", type=Path, help="docs/results/NAME/records.json (created when missing)")
    s.add_argument("archives", type=Path, nargs="+")
    s.add_argument("--wandb-project", help="log each as a W&B artifact of this project (offline unless WANDB_MODE)")
    s.add_argument("--url-prefix", help="where the archives are uploaded (a release's download URL)")
    s.add_argument("--git-commit", help="the commit that holds them at their path in this repository")
    args = parser.parse_args(argv)
    try:
        if args.command in ("fetch", "publish"):
            return _store(args)
        if args.command == "pack":
            runs = pack(args.sweep, args.out, args.skip)
            size = f"{args.out.stat().st_size / 1e6:.2f} MB" if runs else "nothing new to pack, no file written"
            print(f"{args.out}: {len(runs)} finished run(s) ({size})")
        else:
            written, same = unpack(args.archives, args.into, args.max_member_mb, args.max_total_mb)
            runs = len(archived_runs(args.archives))
            print(f"{args.into}: {runs} run(s) from {len(args.archives)} archive(s), {written} file(s) written, "
                  f"{same} already there")
    except (RunError, OSError, tarfile.TarError) as err:
        print(f"moe-rl-archive: {one_line(err) or err}", file=sys.stderr)
        return 1
    return 0


def _store(args: argparse.Namespace) -> int:
    if args.command == "publish":
        for entry in records.publish(args.manifest, args.archives, args.wandb_project, args.url_prefix, args.git_commit):
            print(f"{args.manifest}: {entry.file} ({entry.runs} runs, sha256 {entry.sha256[:16]}...) from "
                  f"{', '.join(entry.sources)}")
        return 0
    out = args.out or Path("records") / records.study(args.manifest)
    got = records.fetch(args.manifest, out)
    for path, source in got:
        print(f"{path}: {source}")
    if args.into:
        written, same = unpack([p for p, _ in got], args.into)
        print(f"{args.into}: {written} file(s) written, {same} already there")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
