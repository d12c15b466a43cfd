"""Local logs, the guarded W&B sink, and the run's MetricSink over both (a NullSink on other ranks)."""

import json
import math
import warnings

from moe_rl.trainer.logging import CollapseAlerts, LocalLog, MetricSink, NullSink, Wandb, open_wandb


def test_wandb_failure_never_raises(tmp_path):
    """A W&B call that fails (logging to a finished run) warns once and stops calling W&B instead of raising."""
    wb = open_wandb(tmp_path, {"a": 1}, mode="offline", project="moe-rl-test", entity=None, group="g", name="n",
                    tags=["t"])
    assert isinstance(wb, Wandb)
    wb.log({"x": 1.0}, step=0)
    wb.run.finish()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wb.log({"x": 2.0}, step=1)
        wb.log({"x": 3.0}, step=2)
    assert wb.failed and len([w for w in caught if "W&B call failed" in str(w.message)]) == 1
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_wandb_that_cannot_start_gives_null_logger(tmp_path):
    """A W&B run that cannot start (invalid mode) becomes a do-nothing logger with a warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wb = open_wandb(tmp_path, {}, mode="bogus", project="p", entity=None, group="g", name="n", tags=[])
    assert not isinstance(wb, Wandb) and any("W&B could not start" in str(w.message) for w in caught)
    wb.log({"x": 1.0}, step=0)


def test_local_log_truncates_on_resume_and_keeps_nan(tmp_path):
    """metrics.jsonl keeps NaN visible as a string and is cut back to the resume step."""
    log = LocalLog(tmp_path, resume_step=None)
    for step in range(4):
        log.log(step, {"a": float(step), "b": math.nan})
    LocalLog(tmp_path, resume_step=2)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and rows[0]["b"] == "nan"


class _Recorder:
    """A W&B stand-in that records its calls."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_metric_sink_writes_the_local_files_and_forwards_to_wandb_in_order(tmp_path):
    """log: a metrics.jsonl row and the same metrics to W&B; event: an events.jsonl line, then a tag and an
    alert; finish: summary.json, then W&B's summary, then W&B closed. A NullSink takes every call."""
    wb = _Recorder()
    sink = MetricSink(LocalLog(tmp_path, resume_step=None), wb, CollapseAlerts(wb, 0.0, ["nonfinite"]))
    event = {"step": 0, "kind": "nonfinite", "value": math.nan, "threshold": 0.0}
    summary = {"steps_done": 1, "stopped_on_collapse": event, "collapse_events": [event]}
    for target in (sink, NullSink()):
        target.log(0, {"a": 1.0})
        target.event(event)
        target.finish(summary)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 0, "a": 1.0}
    assert json.loads((tmp_path / "events.jsonl").read_text())["kind"] == "nonfinite"
    assert json.loads((tmp_path / "summary.json").read_text())["steps_done"] == 1
    assert [c[0] for c in wb.calls] == ["log", "add_tag", "alert", "summary", "finish"]
    assert wb.calls[0] == ("log", ({"a": 1.0},), {"step": 0})
    assert wb.calls[3][1] == ({"stopped_on_collapse": True, "collapse/total": 1},)
