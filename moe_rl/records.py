"""The record store: a sweep's raw records live outside the source tree, and a committed manifest says where
to get each archive back and what its bytes must hash to.

    moe-rl-archive publish docs/results/NAME/records.json records/NAME/20261205T152306Z.tar.xz --wandb-project P
    moe-rl-archive fetch docs/results/NAME/records.json                       # into records/NAME/, verified
    moe-rl-archive fetch docs/results/NAME/records.json --into multirun/NAME  # and unpacked into the sweep

- **The manifest** (`docs/results/NAME/records.json`, committed beside the report) lists each archive of the
  study (moe_rl.archive's .tar.xz of finished runs) by file name, sha256, size and run count, with the
  sources it can be fetched from, tried in order:
  - `git:COMMIT:PATH`: the archive as committed at COMMIT (records the repository held before the store
    existed stay reachable from history; a shallow clone needs `git fetch --unshallow` first);
  - `wandb:[ENTITY/]PROJECT/NAME:ALIAS`: a W&B artifact of type `run-records`. `publish` logs it like the runs
    (offline unless WANDB_MODE says otherwise; `wandb sync` uploads it), under the alias `sha256-<16 hex>`;
  - `https://...` (or `file://...`): a release asset or any URL.
- **Nothing unverified lands.** `fetch` writes each source's bytes to a temporary file, keeps them only when
  their size and sha256 match the manifest, and otherwise tries the next source; an archive no source
  delivers is one line naming every source and why it failed. A file already in the output folder with
  the manifest's checksum is kept; one with other bytes is refused, never replaced.
- **A manifest entry is never rewritten.** `publish` adds an archive, or new sources for one it already
  lists with the same checksum, and refuses a file name it lists with another checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from moe_rl.errors import RunError

ARTIFACT_TYPE = "run-records"
CHUNK = 1 << 20


@dataclass
class Entry:
    """One archive of a study: its file name, checksum, size in bytes, run count and sources (tried in order)."""

    file: str
    sha256: str
    bytes: int
    runs: int
    sources: list[str] = field(default_factory=list)


def archived_runs(archives: Iterable[Path]) -> set[PurePosixPath]:
    """The run folders (relative paths) whose summary.json one of `archives` holds."""
    runs = set()
    for archive in archives:
        with tarfile.open(archive, "r:*") as tar:
            runs |= {PurePosixPath(m.name).parent for m in tar.getmembers() if PurePosixPath(m.name).name == "summary.json"}
    return runs



def first_line(what: BaseException | str) -> str:
    """The first non-empty line of an error's or a tool's message (the exception's type when it has none)."""
    lines = [line.strip() for line in str(what).splitlines() if line.strip()]
    return lines[0] if lines else type(what).__name__


def sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in chunks."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_manifest(path: Path) -> list[Entry]:
    """The entries of manifest `path`; [] when it does not exist. RunError (naming the file) when malformed."""
    if not path.exists():
        return []
    try:
        return [Entry(**e) for e in json.loads(path.read_text())["archives"]]
    except (ValueError, KeyError, TypeError) as err:
        raise RunError(f"{path}: not a records manifest ({first_line(err)})") from None


def write_manifest(path: Path, entries: Sequence[Entry]) -> None:
    about = ("Raw run records of this study, outside the source tree (moe_rl.records): "
             "`moe-rl-archive fetch` this file to get them back, verified against sha256.")
    body = {"about": about, "archives": [asdict(e) for e in sorted(entries, key=lambda e: e.file)]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1) + "\n")


def study(manifest: Path) -> str:
    """The study a manifest belongs to: the name of the folder that holds it."""
    return manifest.resolve().parent.name


# --- publish -----------------------------------------------------------------------------------------


def wandb_source(archive: Path, name: str, digest: str, project: str) -> str:
    """Log `archive` as a `run-records` artifact `name` of W&B `project` (offline unless WANDB_MODE says
    otherwise) under the alias sha256-<16 hex>; returns the manifest's source for it."""
    import wandb  # only when publishing to W&B

    alias = f"sha256-{digest[:16]}"
    mode = os.environ.get("WANDB_MODE", "offline")
    run = wandb.init(project=project, job_type="publish-records", mode=mode, settings=wandb.Settings(silent=True))
    try:
        artifact = wandb.Artifact(name, type=ARTIFACT_TYPE, metadata={"file": archive.name, "sha256": digest})
        artifact.add_file(str(archive), name=archive.name)
        run.log_artifact(artifact, aliases=[alias])
    finally:
        run.finish()
    return f"wandb:{project}/{name}:{alias}"


def git_source(archive: Path, digest: str, commit: str) -> str:
    """The source `git:COMMIT:PATH` for `archive` (sha256 `digest`) as committed at `commit` (PATH relative
    to its repository); RunError when that commit does not hold these bytes."""
    root = Path(_git(archive.parent, "rev-parse", "--show-toplevel").strip())
    rel = archive.resolve().relative_to(root.resolve()).as_posix()
    full = _git(root, "rev-parse", "--verify", f"{commit}^{{commit}}").strip()
    with tempfile.TemporaryDirectory() as tmp:
        got = Path(tmp) / "blob"
        _from_git(root, full, rel, got)
        if sha256(got) != digest:
            raise RunError(f"{archive}: commit {full[:12]} holds other bytes at {rel}")
    return f"git:{full}:{rel}"


def publish(manifest: Path, archives: Sequence[Path], wandb_project: str | None = None,
            url_prefix: str | None = None, git_commit: str | None = None) -> list[Entry]:
    """Add `archives` to `manifest` with the sources asked for (module docstring); returns the entries
    written. RunError for an archive the manifest lists with another checksum, or one with no source."""
    entries = {e.file: e for e in read_manifest(manifest)}
    added = []
    for archive in archives:
        digest = sha256(archive)
        entry = entries.get(archive.name) or Entry(archive.name, digest, archive.stat().st_size,
                                                   len(archived_runs([archive])))
        if entry.sha256 != digest:
            raise RunError(f"{manifest} lists {archive.name} with sha256 {entry.sha256[:16]}..., not {digest[:16]}...: "
                           "an entry is never rewritten; give the archive a new name")
        sources = [git_source(archive, digest, git_commit)] if git_commit else []
        sources += [f"{url_prefix.rstrip('/')}/{archive.name}"] if url_prefix else []
        sources += [wandb_source(archive, f"{study(manifest)}-records", digest, wandb_project)] if wandb_project else []
        if not sources and not entry.sources:
            raise RunError(f"{archive}: no source to publish it to: give --wandb-project, --url-prefix or --git-commit")
        entry.sources += [s for s in sources if s not in entry.sources]
        entries[archive.name] = entry
        added.append(entry)
    write_manifest(manifest, list(entries.values()))
    return added


# --- fetch -------------------------------------------------------------------------------------------


def _git(where: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RunError(f"git {' '.join(args)}: {first_line(done.stderr) or 'failed'}")
    return done.stdout


def _from_git(root: Path, commit: str, path: str, out: Path) -> None:
    if subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{commit}^{{commit}}"],
                      capture_output=True, check=False).returncode:
        raise RunError(f"commit {commit[:12]} is not in this clone (a shallow clone? `git fetch --unshallow`)")
    with out.open("wb") as f:
        done = subprocess.run(["git", "-C", str(root), "show", f"{commit}:{path}"], stdout=f,
                              stderr=subprocess.PIPE, check=False)
    if done.returncode:
        raise RunError(f"git show {commit[:12]}:{path}: {first_line(done.stderr.decode()) or 'failed'}")


def _from_wandb(ref: str, file: str, out: Path) -> None:
    import wandb  # only for this source

    with tempfile.TemporaryDirectory() as tmp:
        try:
            folder = wandb.Api(timeout=30).artifact(ref, type=ARTIFACT_TYPE).download(root=tmp)
        except Exception as err:  # the client raises many kinds (no login, no network, no such artifact)
            raise RunError(f"W&B artifact {ref}: {type(err).__name__}: {first_line(err)}") from None
        shutil.move(Path(folder) / file, out)


def _from_url(url: str, limit: int, out: Path) -> None:
    with urllib.request.urlopen(url, timeout=60) as response, out.open("wb") as f:  # noqa: S310 (the manifest's URL)
        got = 0
        while chunk := response.read(CHUNK):
            got += len(chunk)
            if got > limit:
                raise RunError(f"{url}: more than the manifest's {limit} bytes")
            f.write(chunk)


def fetch_one(entry: Entry, out: Path, root: Path) -> str:
    """Bring `entry`'s archive to `out` from the first source whose bytes match; returns that source.
    RunError naming every source and why it failed when none does."""
    failures = []
    for source in entry.sources:
        tmp = out.with_name(out.name + ".fetching")
        try:
            kind, _, rest = source.partition(":")
            if kind == "git":
                commit, _, path = rest.partition(":")
                _from_git(root, commit, path, tmp)
            elif kind == "wandb":
                _from_wandb(rest, entry.file, tmp)
            elif kind in ("https", "http", "file"):
                _from_url(source, entry.bytes, tmp)
            else:
                raise RunError(f"unknown kind of source {kind!r} (git:, wandb:, https://, file://)")
            if tmp.stat().st_size != entry.bytes or sha256(tmp) != entry.sha256:
                raise RunError("bytes differ from the manifest's checksum")
            tmp.replace(out)
            return source
        except (RunError, OSError) as err:
            failures.append(f"{source}: {first_line(err)}")
        finally:
            tmp.unlink(missing_ok=True)
    raise RunError(f"{entry.file}: no source delivered it ({'; '.join(failures) or 'the manifest lists none'})")


def fetch(manifest: Path, out: Path) -> list[tuple[Path, str]]:
    """Every archive of `manifest` in folder `out`, verified: [(path, where it came from)], "present" for
    one already there. RunError when one cannot be fetched, or is there with other bytes."""
    entries = read_manifest(manifest)
    if not entries:
        raise RunError(f"{manifest}: no such manifest, or it lists no archive")
    try:
        root = Path(_git(manifest.parent, "rev-parse", "--show-toplevel").strip())
    except RunError:  # a manifest outside any repository: its git sources fail, the others still serve
        root = manifest.parent
    out.mkdir(parents=True, exist_ok=True)
    got = []
    for entry in entries:
        path = out / entry.file
        if path.exists():
            if sha256(path) != entry.sha256:
                raise RunError(f"{path} exists with bytes other than {manifest}'s checksum: moved nothing; "
                               "remove it or fetch into another folder")
            got.append((path, "present"))
            continue
        got.append((path, fetch_one(entry, path, root)))
    return got
