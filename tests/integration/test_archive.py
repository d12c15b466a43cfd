"""moe-rl-archive: a sweep's finished runs carried to a machine that kept nothing, and left as they are there."""

import io
import json
import tarfile
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from analysis.load import load_local
from moe_rl.archive import RECORD, archived_runs, main, pack, record_bytes, unpack
from moe_rl.errors import RunError
from moe_rl.trainer.run import train
from tests.integration.test_train_loop import TINY, compose_config


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A sweep folder of two finished 2-step runs (seeds 0 and 1) and one killed run (no summary.json)."""
    root = tmp_path_factory.mktemp("sweep")
    cfg = compose_config([*TINY, "warmstart.enabled=false", "logger.wandb=false"])
    for seed in (0, 1):
        train(replace(cfg, seed=seed), root / str(seed))
    (root / "2").mkdir()
    (root / "2" / "metrics.jsonl").write_text('{"step": 0}\n')
    return root, cfg


def test_pack_then_unpack_gives_the_same_runs_and_a_resume_leaves_them_as_they_are(sweep, tmp_path, capsys):
    """The archive holds only RECORD files of the finished runs; unpacked on a bare folder, analysis loads
    the same runs, and resume=true over them returns their summaries without training or writing."""
    root, cfg = sweep
    out = tmp_path / "runs" / "one.tar.xz"
    assert main(["pack", str(root), str(out)]) == 0
    assert "2 finished run(s)" in capsys.readouterr().out
    with tarfile.open(out) as tar:
        names = {m.name for m in tar.getmembers()}
    assert {n.split("/", 1)[1] for n in names} <= set(RECORD) and {n.split("/")[0] for n in names} == {"0", "1"}
    assert not any("checkpoint" in n or "policy" in n or "wandb" in n for n in names)
    assert record_bytes("summary.json", f'{{"p": "{Path.home()}/x"}}'.encode()) == b'{"p": "~/x"}'
    with tarfile.open(out) as tar:  # no folder of this machine: the home folder is written ~
        assert not any(str(Path.home()).encode() in tar.extractfile(m).read() for m in tar.getmembers())
    assert main(["unpack", str(out), "--into", str(root)]) == 0, "the sweep's own files count as equal"
    capsys.readouterr()
    bare = tmp_path / "bare"
    assert main(["unpack", str(out), "--into", str(bare)]) == 0
    assert "2 run(s) from 1 archive(s)" in capsys.readouterr().out
    def loaded(folder):  # as JSON text: a NaN in a metrics row equals itself there
        return json.dumps({r.seed: (r.config, r.rows, r.events) for r in load_local([folder], progress=False)})

    assert loaded(bare) == loaded(root)
    before = {p: p.read_bytes() for p in bare.rglob("*") if p.is_file()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(replace(cfg, seed=1, resume=True), bare / "1")
    assert any("already finished at step 2 (its checkpoints are gone)" in str(w.message) for w in caught)
    assert summary["run_id"] == (root / "1" / "run_id.txt").read_text().strip()
    after = {p: p.read_bytes() for p in bare.rglob("*") if p.is_file() and ".moe-rl." not in p.name}
    assert after == before, "a resume over an unpacked finished run changed its files"


def test_each_sitting_packs_only_its_new_runs_and_nothing_is_replaced(sweep, tmp_path):
    """--skip leaves archived runs out (nothing new: no file); an existing output, a clashing file and a
    member outside the folder are refused before anything is written."""
    root, _ = sweep
    first = tmp_path / "a.tar.xz"
    assert len(pack(root, first)) == 2
    assert pack(root, tmp_path / "b.tar.xz", skip=[first]) == [] and not (tmp_path / "b.tar.xz").exists()
    with pytest.raises(RunError, match="exists: give the archive a new name"):
        pack(root, first)
    assert {str(r) for r in archived_runs([first])} == {"0", "1"}
    into = tmp_path / "into"
    (into / "0").mkdir(parents=True)
    (into / "0" / "summary.json").write_text("{}")
    with pytest.raises(RunError, match=r"0/summary\.json exists with other bytes .*nothing unpacked"):
        unpack([first], into)
    assert [p.name for p in into.rglob("*") if p.is_file()] == ["summary.json"]
    evil = tmp_path / "evil.tar.xz"
    with tarfile.open(evil, "w:xz") as tar:
        info = tarfile.TarInfo("../outside.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(RunError, match="outside the folder"):
        unpack([evil], tmp_path / "elsewhere")
    assert not (tmp_path / "outside.txt").exists() and not (tmp_path / "elsewhere").exists()
    assert main(["unpack", str(evil), "--into", str(tmp_path / "x")]) == 1


def _archive(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:xz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_unpacking_untrusted_archives_is_bounded(tmp_path, capsys):
    """Issue 56: a small archive holding a member past --max-member-mb (here 5 MB of zeros in a few KB) or
    past --max-total-mb in all is refused before anything is written, in one line, and a raised cap lets
    it through; a member named `run0/.` (a folder) is refused, so no later archive trips over a file `run0`."""
    bomb = _archive(tmp_path / "bomb.tar.xz", {"run0/metrics.jsonl": bytes(5_000_000)})
    assert bomb.stat().st_size < 10_000
    into = tmp_path / "into"
    assert main(["unpack", str(bomb), "--into", str(into), "--max-member-mb", "1"]) == 1
    assert "over --max-member-mb=1" in capsys.readouterr().err and not into.exists()
    two = _archive(tmp_path / "two.tar.xz", {"a/metrics.jsonl": bytes(600_000), "b/metrics.jsonl": bytes(600_000)})
    with pytest.raises(RunError, match="over --max-total-mb=1 MB"):
        unpack([two], into, max_member_mb=1, max_total_mb=1)
    assert not into.exists()
    assert unpack([bomb], into, max_member_mb=6) == (1, 0)
    assert (into / "run0" / "metrics.jsonl").stat().st_size == 5_000_000
    dot = _archive(tmp_path / "dot.tar.xz", {"run1/.": b"x"})
    with pytest.raises(RunError, match=r"'run1/\.' names a folder"):
        unpack([dot], into)
    assert not (into / "run1").exists()


def test_unpacking_never_writes_through_a_link_or_a_file_in_the_path(tmp_path):
    """A symbolic link inside the target folder pointing outside, or a file where a folder must be, stops
    the unpack before anything is written: nothing lands outside, nothing is replaced."""
    outside = tmp_path / "outside"
    outside.mkdir()
    into = tmp_path / "into"
    into.mkdir()
    (into / "run0").symlink_to(outside, target_is_directory=True)
    archive = _archive(tmp_path / "a.tar.xz", {"run0/metrics.jsonl": b"{}\n", "run9/summary.json": b"{}"})
    with pytest.raises(RunError, match=r"run0 is a symbolic link"):
        unpack([archive], into)
    assert list(outside.iterdir()) == [] and not (into / "run9").exists()
    (into / "run0").unlink()
    (into / "run0").write_text("a file")
    with pytest.raises(RunError, match=r"run0 is a file where"):
        unpack([archive], into)
    assert (into / "run0").read_text() == "a file" and not (into / "run9").exists()
