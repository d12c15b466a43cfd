"""The record store (moe_rl.records): archives published outside the tree come back from the sources a
committed manifest names, verified against its checksum, or not at all."""

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from moe_rl.archive import main
from moe_rl.errors import RunError
from moe_rl.records import Entry, fetch, publish, read_manifest, sha256, write_manifest
from tests.helpers.wandb_offline import records

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def _archive(path: Path, payload: bytes) -> Path:
    """A stand-in archive: the store moves bytes and never opens them, except to count runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:xz") as tar:
        for run in ("ws0/0", "ws0/1"):
            info = tarfile.TarInfo(f"{run}/summary.json")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path


@pytest.fixture
def repo(tmp_path):
    """A repository whose history holds one study's archive, removed from the tree by a later commit."""
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    archive = _archive(root / "docs/results/study/records/20260101T000000Z.tar.xz", b'{"seed": 1}')
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "records in the tree")
    manifest = root / "docs/results/study/records.json"
    publish(manifest, [archive], git_commit="HEAD")
    original = archive.read_bytes()
    _git(root, "rm", "-rq", "docs/results/study/records")
    _git(root, "add", str(manifest))
    _git(root, "commit", "-qm", "records out of the tree")
    return root, manifest, original


def test_records_removed_from_the_tree_come_back_from_the_commit_that_held_them(repo, tmp_path):
    """fetch restores an archive from its git source with the same bytes, counts its runs, and a second fetch
    keeps the verified file as it is."""
    root, manifest, original = repo
    (entry,) = read_manifest(manifest)
    assert (entry.runs, entry.bytes) == (2, len(original)) and entry.sources[0].startswith("git:")
    out = tmp_path / "out"
    ((path, source),) = fetch(manifest, out)
    assert path.read_bytes() == original and source == entry.sources[0]
    assert fetch(manifest, out) == [(path, "present")]


def test_a_source_with_other_bytes_is_skipped_for_the_next_and_none_lands_unverified(repo, tmp_path):
    """A URL serving other bytes is passed over for the next source; when every source fails, the error
    names each with its reason and no file is left behind."""
    root, manifest, original = repo
    wrong = tmp_path / "wrong.tar.xz"
    wrong.write_bytes(b"x" * len(original))
    right = tmp_path / "right.tar.xz"
    right.write_bytes(original)
    (entry,) = read_manifest(manifest)
    write_manifest(manifest, [Entry(entry.file, entry.sha256, entry.bytes, entry.runs,
                                    [wrong.as_uri(), "git:" + "0" * 40 + ":nowhere", right.as_uri()])])
    ((path, source),) = fetch(manifest, tmp_path / "a")
    assert source == right.as_uri() and path.read_bytes() == original
    write_manifest(manifest, [Entry(entry.file, entry.sha256, entry.bytes, entry.runs,
                                    [wrong.as_uri(), "git:" + "0" * 40 + ":nowhere", "ftp://x"])])
    with pytest.raises(RunError) as err:
        fetch(manifest, tmp_path / "b")
    message = str(err.value)
    assert "checksum" in message and "not in this clone" in message and "unknown kind of source 'ftp'" in message
    assert list((tmp_path / "b").iterdir()) == []


def test_a_file_in_the_way_with_other_bytes_is_refused_not_replaced(repo, tmp_path):
    """fetch never replaces a file in the output folder whose bytes differ from the manifest's checksum."""
    root, manifest, _ = repo
    (entry,) = read_manifest(manifest)
    (tmp_path / entry.file).write_bytes(b"mine")
    with pytest.raises(RunError, match="exists with bytes other than"):
        fetch(manifest, tmp_path)
    assert (tmp_path / entry.file).read_bytes() == b"mine"


def test_an_entry_is_never_rewritten_and_new_sources_join_it(repo, tmp_path):
    """publish refuses an archive named like a listed one with other bytes, and adds a new source to a listed
    archive with the same bytes without duplicating its entry."""
    root, manifest, original = repo
    (entry,) = read_manifest(manifest)
    other = _archive(tmp_path / entry.file, b'{"seed": 2}')
    with pytest.raises(RunError, match="never rewritten"):
        publish(manifest, [other])
    same = tmp_path / "again" / entry.file
    same.parent.mkdir()
    same.write_bytes(original)
    publish(manifest, [same], url_prefix="https://example.org/releases/v1/")
    (again,) = read_manifest(manifest)
    assert again.sources == [*entry.sources, f"https://example.org/releases/v1/{entry.file}"]
    with pytest.raises(RunError, match="no source to publish it to"):
        publish(tmp_path / "new.json", [same])


def test_publish_logs_a_w_and_b_artifact_offline_and_a_missing_artifact_falls_through(repo, tmp_path, monkeypatch):
    """With a W&B project, publish logs the archive as a run-records artifact of an offline run (synced
    later), names it in the manifest, and fetch, unable to reach W&B, says why and takes the next source."""
    root, manifest, original = repo
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: no network, no waiting
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    archive = tmp_path / "pub" / read_manifest(manifest)[0].file
    archive.parent.mkdir()
    archive.write_bytes(original)
    (entry,) = publish(manifest, [archive], wandb_project="moe-rl-records")
    ref = f"wandb:moe-rl-records/study-records:sha256-{sha256(archive)[:16]}"
    assert entry.sources[-1] == ref
    logged = [r.artifact for r in records(tmp_path) if r.WhichOneof("record_type") == "artifact"]
    assert [(a.name, a.type) for a in logged] == [("study-records", "run-records")]
    assert entry.file in str(logged[0].manifest) and "sha256-" in " ".join(logged[0].aliases)
    write_manifest(manifest, [Entry(entry.file, entry.sha256, entry.bytes, entry.runs, [ref])])
    with pytest.raises(RunError, match=r"W&B artifact moe-rl-records/study-records:sha256-\w+: \w+Error: \S"):
        fetch(manifest, tmp_path / "none")
    write_manifest(manifest, [Entry(entry.file, entry.sha256, entry.bytes, entry.runs, [ref, archive.as_uri()])])
    ((path, source),) = fetch(manifest, tmp_path / "out")
    assert source == archive.as_uri() and path.read_bytes() == original


def test_the_command_fetches_and_unpacks_a_study(repo, tmp_path, capsys):
    """`moe-rl-archive fetch MANIFEST --out DIR --into SWEEP` prints each archive's source and unpacks its runs;
    a manifest that does not exist is one line and exit status 1."""
    root, manifest, _ = repo
    assert main(["fetch", str(manifest), "--out", str(tmp_path / "out"), "--into", str(tmp_path / "sweep")]) == 0
    printed = capsys.readouterr().out
    assert "git:" in printed and "2 file(s) written" in printed
    assert (tmp_path / "sweep/ws0/1/summary.json").read_text() == '{"seed": 1}'
    assert main(["fetch", str(tmp_path / "none.json")]) == 1
    assert "no such manifest" in capsys.readouterr().err


@pytest.mark.parametrize("manifest", sorted(RESULTS.glob("*/records.json")), ids=lambda p: p.parent.name)
def test_every_committed_manifest_names_a_source_that_holds_its_bytes(manifest):
    """Each committed records.json parses, and each archive's git source is a commit that holds a blob of the
    listed size at its path (checked where this clone has the commit; a shallow clone checks the form)."""
    entries = read_manifest(manifest)
    assert entries and all(e.sources and len(e.sha256) == 64 and e.runs > 0 for e in entries)
    names = json.loads(manifest.read_text())["archives"]
    assert [n["file"] for n in names] == sorted(e.file for e in entries)
    for entry in entries:
        for source in entry.sources:
            if not source.startswith("git:"):
                continue
            _, commit, path = source.split(":", 2)
            assert len(commit) == 40 and path.endswith(entry.file)
            have = subprocess.run(["git", "-C", str(RESULTS), "cat-file", "-e", f"{commit}^{{commit}}"],
                                  capture_output=True, check=False).returncode == 0
            if have:
                assert int(_git(RESULTS, "cat-file", "-s", f"{commit}:{path}")) == entry.bytes
