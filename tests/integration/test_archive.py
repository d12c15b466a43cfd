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
