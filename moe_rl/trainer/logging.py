"""Metric sinks: a local JSONL file always, W&B when enabled. A W&B failure never stops training.

One `MetricSink` per run on rank 0 (`metric_sink`) holds the local log, W&B and the collapse alerts:
`log(step, metrics)`, `event(event)`, `finish(summary)`. Ranks other than 0 hold a `NullSink`, which also
stands in for W&B when it is off or cannot start.

NaN/inf convention, the same in metrics.jsonl, events.jsonl and summary.json: a non-finite float is
written as the string "nan", "inf" or "-inf" (`to_json`), so every file is strict JSON (jq, Node's
JSON.parse); `float(value)` reads such a string back (`from_json_number`).
"""

from __future__ import annotations

import json
import os
import time
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moe_rl.config import LoggerConfig
from moe_rl.errors import RunError
from moe_rl.json_numbers import from_json_number, jsonable, to_json  # noqa: F401 - the logs' convention, re-exported


class CorruptLogError(RunError, ValueError):
    """A line of a JSONL log that is not JSON; the message names the file and the line. A RunError, so
    a resume that meets one ends in that line, not a traceback."""


def read_jsonl(path: Path) -> list[dict]:
    """The objects of a JSONL file. A truncated last line (a write cut by a kill) is dropped with a
    warning naming the file; a corrupt line elsewhere raises CorruptLogError naming file and line."""
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1 or all(not rest.strip() for rest in lines[i + 1 :]):
                warnings.warn(
                    f"{path}: dropping a truncated last line {i + 1} ({err.msg})",
                    RuntimeWarning,
                    stacklevel=2,
                )
                break
            raise CorruptLogError(f"{path}, line {i + 1}: not JSON ({err.msg}); fix or delete that line") from err
    return rows


class LocalLog:
    """`metrics.jsonl` (one object per step) and `events.jsonl` in the run folder.

    On resume the files are cut back to the checkpoint's step, so a resumed run's log equals an
    uninterrupted one.
    """

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        self.metrics_path = run_dir / "metrics.jsonl"
        self.events_path = run_dir / "events.jsonl"
        for path in (self.metrics_path, self.events_path):
            self._truncate(path, resume_step)

    @staticmethod
    def _truncate(path: Path, resume_step: int | None) -> None:
        if resume_step is None or not path.exists():
            path.unlink(missing_ok=True)
            return
        kept = [row for row in read_jsonl(path) if row.get("step", -1) < resume_step]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(to_json(row) + "\n" for row in kept))
        os.replace(tmp, path)  # a kill here leaves the old file or the new one, never half of one

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(to_json({"step": step, **metrics}) + "\n")

    def event(self, event: dict) -> None:
        with self.events_path.open("a") as f:
            f.write(to_json(event) + "\n")

    def summary(self, summary: dict) -> None:
        """Write `summary.json` (next to the logs, swapped in whole)."""
        tmp = self.metrics_path.with_name(".summary.json.tmp")
        tmp.write_text(to_json(summary, indent=2))
        tmp.replace(self.metrics_path.with_name("summary.json"))


class NullSink:
    """Stands in for a sink that writes nothing: W&B when it is off or cannot start, and the run's
    `MetricSink` on ranks other than 0. Every call does nothing; `log` and `finish` take either sink's
    arguments."""

    def log(self, *args: object, **kwargs: object) -> None:
        pass

    def event(self, event: dict) -> None:
        pass

    def summary(self, values: dict) -> None:
        pass

    def alert(self, title: str, text: str, wait_s: float) -> None:
        pass

    def add_tag(self, tag: str) -> None:
        pass

    def finish(self, *args: object) -> None:
        pass


class Wandb:
    """A W&B run whose every call is guarded: after an error it warns once and stops calling W&B.

    The run id is kept in the run folder, so a resumed run continues the same W&B run.
    """

    def __init__(
        self,
        run_dir: Path,
        config: dict,
        *,
        mode: str,
        project: str,
        entity: str | None,
        group: str,
        name: str,
        tags: list[str],
        init_timeout_s: float = 20.0,
    ) -> None:
        import wandb

        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=project,
            entity=entity,
            group=group,
            name=name,
            tags=tags,
            config=config,
            dir=str(run_dir),
            mode=mode,
            id=run_id,
            resume="allow",
            reinit="create_new",
            # A server that does not answer (a rejected key, no network) gives up after init_timeout_s
            # instead of W&B's default 90 s; open_wandb then continues with local logs only.
            settings=wandb.Settings(silent=True, console="off", init_timeout=init_timeout_s),
        )
        self.failed = False

    def _guard(self, fn) -> None:
        if self.failed:
            return
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - logging must never stop training
            warnings.warn(f"W&B call failed; continuing with local logs only: {err}", stacklevel=3)
            self.failed = True

    def log(self, metrics: dict, step: int) -> None:
        self._guard(lambda: self.run.log(metrics, step=step))

    def summary(self, values: dict) -> None:
        self._guard(lambda: self.run.summary.update(values))

    def alert(self, title: str, text: str, wait_s: float) -> None:
        """`wandb.alert` (offline it is stored in the run and sent by `wandb sync`)."""
        self._guard(lambda: self.run.alert(title=title, text=text, level="WARN", wait_duration=wait_s))

    def add_tag(self, tag: str) -> None:
        """Add a tag to the run (once), keeping its others."""

        def add() -> None:
            tags = tuple(self.run.tags or ())
            if tag not in tags:
                self.run.tags = (*tags, tag)

        self._guard(add)

    def finish(self) -> None:
        self._guard(self.run.finish)


def open_wandb(run_dir: Path, config: dict, **kwargs: Any) -> Wandb | NullSink:
    """Start W&B, or return a NullSink (with a warning) if it cannot start."""
    try:
        return Wandb(run_dir, config, **kwargs)
    except Exception as err:  # noqa: BLE001
        reason = " ".join(str(err).split())  # one line, whatever W&B's message looks like
        warnings.warn(f"W&B could not start ({reason}); training continues with local logs only", stacklevel=2)
        return NullSink()


class CollapseAlerts:
    """Turns collapse events into W&B alerts and `collapsed:<kind>` run tags.

    Only events of a kind in `kinds` (`logger.alert_kinds`) alert or tag; the others are logged only.
    Rate-limited per kind: an event within `interval_s` seconds of the last alert of its kind sends none
    (a run that keeps failing sends one alert, not one per step). Each kind's tag is added once.
    """

    def __init__(self, wb: Wandb | NullSink, interval_s: float, kinds: Iterable[str], clock=time.monotonic) -> None:
        self.wb, self.interval_s, self.kinds, self.clock = wb, interval_s, frozenset(kinds), clock
        self.last_sent: dict[str, float] = {}
        self.tagged: set[str] = set()

    def tag_past(self, events: list[dict]) -> None:
        """On resume: tag the kinds of the events before the checkpoint again (no alerts), since the
        resumed W&B run starts from the tags given to `wandb.init`."""
        for kind in dict.fromkeys(e["kind"] for e in events):
            if kind in self.kinds and kind not in self.tagged:
                self.wb.add_tag(f"collapsed:{kind}")
                self.tagged.add(kind)

    def __call__(self, event: dict) -> bool:
        """Alert (unless rate-limited) and tag for one event {step, kind, value, threshold}; True if sent.
        An event of a kind not in `kinds` does neither (False)."""
        kind = event["kind"]
        if kind not in self.kinds:
            return False
        if kind not in self.tagged:
            self.wb.add_tag(f"collapsed:{kind}")
            self.tagged.add(kind)
        now = self.clock()
        if kind in self.last_sent and now - self.last_sent[kind] < self.interval_s:
            return False
        self.last_sent[kind] = now
        text = f"step {event['step']}: value {event['value']:.6g} crossed threshold {event['threshold']:.6g}"
        self.wb.alert(kind, text, self.interval_s)
        return True


class MetricSink:
    """Rank 0's records of a run: metrics.jsonl, events.jsonl and summary.json (`LocalLog`), W&B (a
    `NullSink` when off or when it cannot start) and the W&B alerts and tags of collapse events."""

    def __init__(self, local: LocalLog, wb: Wandb | NullSink, alerts: CollapseAlerts) -> None:
        self.local, self.wb, self.alerts = local, wb, alerts

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One step's metrics, to the local log and W&B."""
        self.local.log(step, metrics)
        self.wb.log(metrics, step=step)

    def event(self, event: dict) -> None:
        """One collapse event {step, kind, value, threshold, ...}: to events.jsonl, then alerted."""
        self.local.event(event)
        self.alerts(event)

    def finish(self, summary: dict) -> None:
        """Write summary.json and W&B's run summary, then close W&B."""
        self.local.summary(summary)
        self.wb.summary({"stopped_on_collapse": bool(summary["stopped_on_collapse"]),
                         "collapse/total": len(summary["collapse_events"])})
        self.wb.finish()


def metric_sink(run_dir: Path, lg: LoggerConfig, resume_step: int | None, config: dict, *, group: str, name: str,
                tags: list[str], past_events: list[dict]) -> MetricSink:
    """Rank 0's sink: the local log (cut back to `resume_step` on resume, else started afresh); W&B with
    `config` as its run config, when `logger.wandb` and its mode is not disabled; alerts as
    `logger.alerts` asks, the kinds of `past_events` (before the checkpoint) tagged again."""
    local = LocalLog(run_dir, resume_step)
    wb: Wandb | NullSink = NullSink()
    if lg.wandb and lg.mode != "disabled":
        wb = open_wandb(run_dir, config, mode=lg.mode, project=lg.project, entity=lg.entity, group=group, name=name,
                        tags=[*tags, *lg.tags], init_timeout_s=lg.init_timeout_s)
    alerts = CollapseAlerts(wb if lg.alerts else NullSink(), lg.alert_interval_s, lg.alert_kinds)
    alerts.tag_past(past_events)
    return MetricSink(local, wb, alerts)
