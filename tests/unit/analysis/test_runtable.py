"""analysis.runtable: the per-run table keeps what the analysis reads of each run, exactly, and a run read
back from it refuses what it does not keep; a report made from it equals the records' report save the
per-step sections and figures, which it names."""

import json
import math

import numpy as np
import pytest

from analysis.cli import main as analyze_main
from analysis.load import NotInTableError, Run
from analysis.report import write_report
from analysis.runtable import bytes_per_run, quantities, read_table, write_table
from tests.unit.analysis.test_analyze_load_group_report import run_config
from tests.unit.analysis.test_staleness_section import stale_runs

NAN, INF = math.nan, math.inf


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    """Equal keys and bitwise-equal floats, nan equal to nan."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def _hand_run() -> Run:
    """Five steps: a NaN and an inf among the values, a key the final row lacks, evals at steps 0 and 3."""
    rows = [
        {"step": 0, "rollout/reward/mean": 0.1, "time/step_s": 1.5, "clip/token_frac": NAN, "collapse/events": 0.0,
         "eval/initial/expected_accuracy": 0.25, "eval/expected_accuracy": 0.3},
        {"step": 1, "rollout/reward/mean": 0.2, "time/step_s": NAN, "clip/token_frac": 0.5, "collapse/events": 0.0,
         "collapse/kind/nonfinite": 1.0},
        {"step": 2, "rollout/reward/mean": 0.4, "time/step_s": 2.0, "clip/token_frac": INF, "collapse/events": 1.0},
        {"step": 3, "rollout/reward/mean": 0.3, "time/step_s": 0.25, "clip/token_frac": 0.25, "collapse/events": 1.0,
         "eval/expected_accuracy": NAN, "eval/accuracy": 0.5},
        {"step": 4, "rollout/reward/mean": 0.7, "time/step_s": 1.0, "clip/token_frac": 0.125, "collapse/events": 2.0},
    ]  # fmt: skip
    config = run_config("grpo", 0, 1e-4)
    return Run(config=config, rows=rows, events=[{"kind": "nonfinite", "step": 1}], source="hand/0",
               provenance={"torch": "2.13.0"})


def test_the_table_keeps_each_quantity_as_a_float64_recomputation_gives_it(tmp_path):
    """mean over finite values, sum of a time/ key, final value of a collapse/ key (absent: not stored), and
    moe-rl-compare's columns, each against arithmetic written out here."""
    run = _hand_run()
    q = quantities(run)
    assert q["mean:clip/token_frac"] == (0.5 + 0.25 + 0.125) / 3
    assert q["mean:rollout/reward/mean"] == np.mean([0.1, 0.2, 0.4, 0.3, 0.7])
    assert q["total:time/step_s"] == 1.5 + 2.0 + 0.25 + 1.0
    assert q["last:collapse/events"] == 2.0
    assert "last:collapse/kind/nonfinite" not in q  # the final row lacks it: Run.last gives the default
    assert "total:rollout/reward/mean" not in q and "last:clip/token_frac" not in q
    assert q["summary:final reward"] == sum([0.1, 0.2, 0.4, 0.3, 0.7]) / 5
    assert q["summary:final expected acc"] == 0.3  # the last finite value
    back = read_table(write_table([run], tmp_path / "runs.parquet"))[0]
    assert _same(back.reduced, q)
    assert back.config == run.config and back.events == run.events and back.provenance == run.provenance
    assert back.keys() == run.keys()
    assert [r["step"] for r in back.rows] == [0, 3]
    assert back.series("eval/accuracy")[1] == 0.5 and math.isnan(back.series("eval/expected_accuracy")[1])
    for method, key, args in (("mean", "clip/token_frac", ()), ("total", "time/step_s", ()),
                              ("last", "collapse/events", (0.0,)), ("last", "collapse/kind/nonfinite", (0.0,))):
        assert getattr(back, method)(key, *args) == getattr(run, method)(key, *args), (method, key)
    assert _same(back.summary(), run.summary()) and list(back.summary()) == list(run.summary())


def test_a_run_read_back_refuses_what_the_table_does_not_keep(tmp_path):
    """A per-step curve, a sum or a final value the table never stored raises, naming the key, rather than
    answering with nan or 0 as a run that never logged it would."""
    back = read_table(write_table([_hand_run()], tmp_path / "runs.parquet"))[0]
    for call, key in ((lambda: back.series("clip/token_frac"), "clip/token_frac"),
                      (lambda: back.total("rollout/reward/mean"), "rollout/reward/mean"),
                      (lambda: back.last("clip/token_frac"), "clip/token_frac")):
        with pytest.raises(NotInTableError, match="moe-rl-archive fetch") as err:
            call()
        assert repr(key) in str(err.value)
    assert math.isnan(back.mean("routing/never_logged"))  # no run logged it: as from the records


def test_a_report_from_the_table_equals_the_records_report_less_its_per_step_sections(tmp_path):
    """On a staleness sweep (48 runs): table.json equal key for key but the staleness section, which reads
    per-step curves; report.md names it and the figures left out; the table written again is the same bytes."""
    runs = stale_runs()
    write_report(runs, tmp_path / "records", "t", ["x"], permutations=200)
    tabled = read_table(tmp_path / "records" / "runs.parquet")
    report = write_report(tabled, tmp_path / "table", "t", ["x"], permutations=200)
    a = json.loads((tmp_path / "records" / "table.json").read_text())
    b = json.loads((tmp_path / "table" / "table.json").read_text())
    assert "staleness" in a and set(a) - set(b) == {"staleness"}
    assert {k: a[k] for k in b} == b
    text = report.read_text()
    assert 'the figures of per-step curves and the section "Expert change against staleness" are left out' in text
    assert "## Expert change against staleness" not in text
    assert not (tmp_path / "table" / "staleness.png").exists() and not (tmp_path / "table" / "reward_vs_step.png").exists()
    assert (tmp_path / "table" / "runs.parquet").read_bytes() == (tmp_path / "records" / "runs.parquet").read_bytes()
    assert bytes_per_run(tmp_path / "table" / "runs.parquet") < 10_000


def test_cli_reads_tables_and_refuses_a_missing_one_or_a_recount(tmp_path, capsys):
    write_table(stale_runs(), tmp_path / "runs.parquet")
    analyze_main([str(tmp_path / "runs.parquet"), "--out", str(tmp_path / "out"), "--permutations", "100"])
    assert "48 runs" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"absent\.parquet: no such folder or table"):
        analyze_main([str(tmp_path / "absent.parquet"), "--out", str(tmp_path / "o2")])
    with pytest.raises(SystemExit, match="--recount reads every step's metrics"):
        analyze_main([str(tmp_path / "runs.parquet"), "--out", str(tmp_path / "o3"), "--recount"])
