"""The comparison table printed at the end of a sweep (and by `moe-rl-compare SWEEP_DIR`).

One row per objective preset and replay source (taken from each run's summary.json, never from
folder names), split further by any command-line override that differs between its runs (a swept
`trainer.lr=...`; seeds never split a row, and a seed found twice counts once). Each cell is the mean
over seeds ± the half-width of its 95% confidence interval (Student t with n - 1 degrees of freedom, n
the seeds with a finite value; analysis.stats.mean_ci):

| column | from metrics.jsonl |
|---|---|
| final reward | mean of `rollout/reward/mean` over the last 5 steps |
| final eval acc | `eval/accuracy` of the last row that has it (held-out eval); the column is left out when no run has it |
| final expected acc | `eval/expected_accuracy` of the last row that has it (teacher-forced, moe_rl.trainer.evaluate); left out when no run has it |
| clip frac | mean over steps of `clip/token_frac` |
| token-ratio var | mean over steps of `ratio/token/var` |
| expert change | mean over steps of `routing/expert_change/response_frac`: the paper's quantity, over response positions (runs from before it was logged fall back to `routing/expert_change/frac`, over all positions) |
| collapse events | total over the run (`collapse/events` at its last step) |
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

from analysis.stats import mean_ci
from moe_rl.errors import one_line_warnings
from moe_rl.provenance import provenance_mismatch
from moe_rl.trainer.folder import set_aside
from moe_rl.trainer.logging import CorruptLogError, from_json_number, read_jsonl

COLUMNS = (
    "final reward",
    "final eval acc",
    "final expected acc",
    "clip frac",
    "token-ratio var",
    "expert change",
    "collapse events",
)


class BrokenRunError(ValueError):
    """A run folder that cannot be read (no summary.json, a corrupt file); the message names it."""


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """A run's summary.json and its metrics.jsonl rows (NaN/inf come back as floats).

    Raises BrokenRunError naming the folder and the reason when either file is missing, corrupt or
    empty, when summary.json is not a run summary (an object with a "seed" and a "label", or the
    "objective" and "replay" it is made of) or a metrics line
    is not an object with a "step" (a truncated last metrics line is only dropped, with a warning).
    """
    if not (run_dir / "summary.json").is_file():
        reason = "failed.json: the run failed" if (run_dir / "failed.json").exists() else "unfinished or killed"
        raise BrokenRunError(f"{run_dir}: no summary.json ({reason})")
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        raw = read_jsonl(run_dir / "metrics.jsonl")
    except FileNotFoundError as err:
        raise BrokenRunError(f"{run_dir}: no {Path(err.filename).name}") from err
    except (CorruptLogError, ValueError) as err:
        raise BrokenRunError(f"{run_dir}: {err}") from err
    if isinstance(summary, dict) and "label" not in summary and {"objective", "replay"} <= summary.keys():
        summary["label"] = f"{summary['objective']} (replay={summary['replay']})"  # as run_label writes it
    if not isinstance(summary, dict) or not {"label", "seed"} <= summary.keys():
        raise BrokenRunError(f"{run_dir}: summary.json is not a run summary (no label and seed)")
    for i, row in enumerate(raw):
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise BrokenRunError(f"{run_dir}: metrics.jsonl row {i + 1} is not a metrics object with a step")
    if not raw:
        raise BrokenRunError(f"{run_dir}: metrics.jsonl has no rows")
    return summary, [{k: from_json_number(v) for k, v in r.items()} for r in raw]


def run_dirs(sweep_dir: Path) -> list[Path]:
    """Every run folder under `sweep_dir` (or the folder itself): any with a summary, metrics or failure.
    An earlier run that overwrite=true moved aside (`overwritten-*/`, moe_rl.trainer.folder) is not one."""
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"{sweep_dir}: no such folder")
    found = {p.parent for name in ("summary.json", "metrics.jsonl", "failed.json") for p in sweep_dir.rglob(name)}
    return sorted(d for d in found if not set_aside(d.relative_to(sweep_dir)))


NOT_A_GROUP = frozenset({
    "seed", "model.seed", "warmstart.seed", "resume", "resume_force", "overwrite", "trainer.threads", "trainer.device",
    "trainer.checkpoint_every", "warmstart.cache_dir",
})
NOT_A_GROUP_PREFIXES = ("logger.", "hydra.", "_", "provenance.")
"""Config fields that never split a row here or a group in analysis.load: seeds are what a row averages
over; the rest (where a run ran, how it resumed and logged) do not change the science. A difference in
provenance (the W&B config's `provenance`) is warned about instead (moe_rl.provenance)."""


def splits_groups(field: str) -> bool:
    """Whether runs differing in `field` (a dotted config key) belong in different rows and groups."""
    return field not in NOT_A_GROUP and not field.startswith(NOT_A_GROUP_PREFIXES)


def _overrides(run_dir: Path) -> tuple[str, ...]:
    """The run's Hydra command-line overrides that can change its numbers (`.hydra/overrides.yaml`)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return ()
    from omegaconf import OmegaConf

    listed = OmegaConf.to_container(OmegaConf.load(path))
    return tuple(sorted(o for o in listed if isinstance(o, str) and splits_groups(o.lstrip("~+").split("=", 1)[0])))


def read_runs(sweep_dir: Path) -> list[tuple[str, dict, list[dict]]]:
    """(label, summary, rows) of every readable run under `sweep_dir`; each broken one is skipped with a
    warning naming it. The label is the run's (objective preset and replay source) plus each override
    whose value differs between its runs (a swept `trainer.lr=...`), so seeds are all a row averages over;
    a second folder with the same label and seed (a copied run) is skipped with a warning naming both.
    Runs whose provenance differs (library versions, CPU kernels, threads: moe_rl.provenance) get one warning."""
    found = []
    for run_dir in run_dirs(sweep_dir):
        try:
            found.append((run_dir, *read_run(run_dir), _overrides(run_dir)))
        except BrokenRunError as err:
            warnings.warn(f"skipping {err}", RuntimeWarning, stacklevel=2)
    by_label: dict[str, list[tuple[str, ...]]] = defaultdict(list)
    for _, summary, _, overrides in found:
        by_label[summary["label"]].append(overrides)
    runs, seen = [], {}
    for run_dir, summary, rows, overrides in found:
        shared = set.intersection(*(set(o) for o in by_label[summary["label"]]))
        label = " ".join([summary["label"], *(o for o in overrides if o not in shared)])
        if (label, summary["seed"]) in seen:
            warnings.warn(
                f"skipping {run_dir}: seed {summary['seed']} of {label} again (also {seen[label, summary['seed']]}); "
                "one seed counts once",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        seen[label, summary["seed"]] = run_dir
        runs.append((label, summary, rows))
    if mismatch := provenance_mismatch([summary.get("provenance") for _, summary, _ in runs]):
        warnings.warn(mismatch, RuntimeWarning, stacklevel=2)
    return runs


def _mean(values: list[float]) -> float:
    finite = [v for v in values if isinstance(v, float | int) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def last_value(rows: list[dict], key: str) -> float:
    """`key` in the last row that has a finite value for it (eval metrics are only on eval steps); nan if none."""
    for row in reversed(rows):
        value = row.get(key)
        if isinstance(value, float | int) and math.isfinite(value):
            return float(value)
    return math.nan


def run_row(rows: list[dict]) -> dict[str, float]:
    """The table's columns for one run."""
    return {
        "final reward": _mean([r.get("rollout/reward/mean", math.nan) for r in rows[-5:]]),
        "final eval acc": last_value(rows, "eval/accuracy"),
        "final expected acc": last_value(rows, "eval/expected_accuracy"),
        "clip frac": _mean([r.get("clip/token_frac", math.nan) for r in rows]),
        "token-ratio var": _mean([r.get("ratio/token/var", math.nan) for r in rows]),
        "expert change": _mean(
            [r.get("routing/expert_change/response_frac", r.get("routing/expert_change/frac", math.nan)) for r in rows]
        ),
        "collapse events": rows[-1].get("collapse/events", math.nan) if rows else math.nan,
    }


def comparison(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """Per label: the seeds found, each column averaged over them, (under "ci95") each column's CI
    half-width, and per column the number of seeds whose value was finite (`n/<column>`): a NaN seed is
    left out of the mean, the CI and that count."""
    by_label: dict[str, list[dict[str, float]]] = defaultdict(list)
    seeds: dict[str, list[int]] = defaultdict(list)
    for label, summary, rows in read_runs(sweep_dir):
        by_label[label].append(run_row(rows))
        seeds[label].append(summary["seed"])
    table = {}
    for label, runs in by_label.items():
        cis = {c: mean_ci([r[c] for r in runs]) for c in COLUMNS}
        table[label] = {
            "seeds": sorted(seeds[label]),
            **{c: ci.mean for c, ci in cis.items()},
            "ci95": {c: ci.half for c, ci in cis.items()},
            **{f"n/{c}": ci.n for c, ci in cis.items()},
        }
    return table


def shown_columns(table: dict[str, dict[str, Any]]) -> list[str]:
    """COLUMNS, less the held-out eval columns no label has a value for (runs without that evaluation)."""
    optional = ("final eval acc", "final expected acc")
    return [c for c in COLUMNS if c not in optional or any(math.isfinite(r[c]) for r in table.values())]


def format_cell(mean: float, half: float) -> str:
    """The cell text: "mean ± half" to 4 and 2 significant digits, "mean ± –" with one seed, "n/a" without a value."""
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.4g} ± " + (f"{half:.2g}" if math.isfinite(half) else "–")


def _cell(row: dict[str, Any], column: str) -> str:
    """`format_cell`, with "(n of N seeds)" when some seeds had no finite value."""
    n, total = row.get(f"n/{column}", len(row["seeds"])), len(row["seeds"])
    return format_cell(row[column], row["ci95"][column]) + (f" ({n} of {total} seeds)" if 0 < n < total else "")


def format_table(table: dict[str, dict[str, Any]]) -> str:
    """Markdown table, one row per label: mean ± 95% CI half-width over seeds (Student t), then the note."""
    columns = shown_columns(table)
    lines = ["| run | seeds | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for label, row in sorted(table.items()):
        cells = [_cell(row, c) for c in columns]
        lines.append(f"| {label} | {len(row['seeds'])} | " + " | ".join(cells) + " |")
    lines.append("\nCells: mean over seeds ± 95% CI half-width (Student t, n - 1 dof).")
    return "\n".join(lines)


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra is a dependency; keeps the module importable alone
    Callback = object


class ComparisonTableCallback(Callback):
    """Hydra callback: after a multirun, print the comparison table of the jobs that finished and save it
    as comparison.md; then, if any job failed (left failed.json), name each and exit 1.

    `blind=True` (`hydra.callbacks.comparison.blind`, set by a pre-registered sweep's config) prints only
    how many runs finished and writes no table, so nobody reads an outcome before the sweep is complete."""

    def __init__(self, blind: bool = False) -> None:
        self.blind = blind

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        failed = sorted(p for p in sweep_dir.rglob("failed.json") if ".hydra" not in p.parts)
        if self.blind:
            done = sum((d / "summary.json").is_file() for d in run_dirs(sweep_dir))
            print(f"\n{sweep_dir}: {done} run(s) finished (blind: no comparison table until the sweep is complete)")
            table = None
        else:
            with warnings.catch_warnings():
                if failed:  # named once below, not also as "skipping ..." lines
                    warnings.filterwarnings("ignore", message=r"skipping .*failed\.json: the run failed")
                table = comparison(sweep_dir)
        if table:
            text = format_table(table)
            (sweep_dir / "comparison.md").write_text(text + "\n")
            print(f"\nComparison ({sweep_dir}):\n{text}")
        if failed:
            jobs = len({p.parent for p in sweep_dir.glob("*/.hydra")}) or len(failed)
            for path in failed:
                try:
                    error = json.loads(path.read_text())["error"].splitlines()[0]
                except (ValueError, KeyError, TypeError, AttributeError):
                    error = "(unreadable failed.json)"
                print(f"moe-rl-train: sweep job {path.parent.relative_to(sweep_dir)} failed: {error}", file=sys.stderr)
            print(f"moe-rl-train: {len(failed)} of {jobs} sweep jobs failed; each folder's failed.json has the "
                  "traceback", file=sys.stderr)
            sys.exit(1)


def main() -> None:
    """`moe-rl-compare SWEEP_DIR`: print the comparison table of a sweep folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    args = parser.parse_args()
    one_line_warnings("moe-rl-compare")
    if not args.sweep_dir.is_dir():
        raise SystemExit(f"moe-rl-compare: {args.sweep_dir}: no such folder")
    table = comparison(args.sweep_dir)
    if not table:
        raise SystemExit(f"no runs with summary.json under {args.sweep_dir}")
    print(format_table(table))


if __name__ == "__main__":
    main()
