"""The per-run table: what the analysis reads of each run, one row per run, in one Parquet file.

A sweep's raw records (metrics.jsonl: every key at every step) live outside the repository, in the
record store (moe_rl.records). The table stays beside its report: write_report writes it as
runs.parquet, and the analysis runs from it alone, `moe-rl-analyze docs/results/NAME/runs.parquet --out
OUT`.

| column | what |
|---|---|
| source | the run's folder or W&B path when it was analysed |
| config, provenance, events | the run's resolved config, its provenance and its collapse events (null for W&B), as JSON |
| logged | every key the run logged at some step (JSON list) |
| evals | the rows that hold an `eval/` key, with those keys and the step only (JSON): the eval curves and every outcome made from them (analysis.outcomes) |
| summary:COLUMN | moe-rl-compare's per-run columns (analysis.compare.run_row) |
| mean:KEY | per logged key: its mean over the run's steps, finite values only (`Run.mean`) |
| total:KEY | per logged `time/` key (a cost): its sum over the run's steps, finite values only (`Run.total`) |
| last:KEY | per logged `collapse/` key (a counter): its value in the run's final row, null when that row lacks it (`Run.last`) |

Every number is float64 and JSON writes floats exactly, so a section gives the same table.json from the
table as from the records, save the sections that read per-step curves (`Section.steps`: the staleness
section) and the report's curve figures, which a report made from the table leaves out and names
(tests/unit/analysis/test_runtable.py and the committed reports' tests hold this). Measured: 1.8 KB per run
for confirm_sort_long's 96 runs of 200 steps, 1.1 KB for router_lr_own_lr's 384, against 36 KB per run for
the 48 analysed keys as exact per-step curves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from analysis.load import EVAL_PREFIX, LASTS, TOTALS, Run

FILE = "runs.parquet"
"""The table's name beside a report (analysis.report.write_report)."""
JSON_COLUMNS = ("config", "provenance", "events", "logged", "evals")
QUANTITIES = ("summary:", "mean:", "total:", "last:")
"""The prefixes of the per-run quantity columns (float64), one column per quantity and key."""


def quantities(run: Run) -> dict[str, float]:
    """The run's per-run quantities by column name (module docstring); a run read from a table gives its own."""
    if run.reduced is not None:
        return dict(run.reduced)
    out = {f"summary:{column}": value for column, value in run.summary().items()}
    final = run.rows[-1] if run.rows else {}
    for key in sorted(run.keys() - {"step"}):
        out[f"mean:{key}"] = run.mean(key)
        if key.startswith(TOTALS):
            out[f"total:{key}"] = run.total(key)
        if key.startswith(LASTS) and key in final:
            out[f"last:{key}"] = float(final[key])
    return out


def eval_rows(run: Run) -> list[dict[str, Any]]:
    """The run's rows that hold an eval key, with the step and those keys only."""
    return [{"step": row["step"], **{k: v for k, v in row.items() if k.startswith(EVAL_PREFIX)}}
            for row in run.rows if any(k.startswith(EVAL_PREFIX) for k in row)]


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))


def write_table(runs: list[Run], path: Path) -> Path:
    """The runs' per-run table as Parquet (zstd) at `path`; returns `path`."""
    per_run = [quantities(run) for run in runs]
    names = sorted(set().union(*per_run))
    columns: dict[str, pa.Array] = {
        "source": pa.array([run.source for run in runs], pa.string()),
        **{name: pa.array([_json(value(run)) for run in runs], pa.string()) for name, value in (
            ("config", lambda r: r.config), ("provenance", lambda r: r.provenance), ("events", lambda r: r.events),
            ("logged", lambda r: sorted(r.keys())), ("evals", lambda r: r.rows if r.reduced is not None else eval_rows(r)),
        )},
        **{name: pa.array([q.get(name) for q in per_run], pa.float64()) for name in names},
    }
    pq.write_table(pa.table(columns), path, compression="zstd", compression_level=19, write_statistics=False)
    return path


def read_table(path: Path) -> list[Run]:
    """The runs of a per-run table: each with its config, events, provenance, eval rows and quantities."""
    runs = []
    for record in pq.read_table(path).to_pylist():
        loaded = {name: None if record[name] is None else json.loads(record[name]) for name in JSON_COLUMNS}
        reduced = {k: v for k, v in record.items() if k.startswith(QUANTITIES) and v is not None}
        runs.append(Run(config=loaded["config"], rows=loaded["evals"], events=loaded["events"],
                        source=record["source"], provenance=loaded["provenance"], reduced=reduced,
                        logged=frozenset(loaded["logged"])))
    return runs


def bytes_per_run(path: Path) -> float:
    """The table's size on disk per run it holds."""
    return path.stat().st_size / max(1, pq.read_metadata(path).num_rows)

