"""Markdown tables and the report page (report.md) that links every figure.

Summary table, one row per group (base label + varying config fields), each column the mean over
seeds of the per-run value that `moe-rl-compare` computes (moe_rl.trainer.compare.run_row):

| column | per run, from metrics.jsonl |
|---|---|
| final reward | mean of `rollout/reward/mean` over the last 5 steps |
| clip frac | mean over steps of `clip/token_frac` |
| token-ratio var | mean over steps of `ratio/token/var` |
| expert change | mean over steps of `routing/expert_change/frac` |
| collapse events | `collapse/events` at the run's last step |

Non-finite values are left out of every mean. table.json holds the same numbers at full precision.

Collapse table: per group, the number of seeds with at least one collapse event (from the metrics'
`collapse/events`), the total events and their kinds (from events.jsonl; unknown for W&B runs). When
config fields vary, a second table per field gives collapsed seeds / seeds for each value and base label.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from analysis.figures import BAND, finite_mean, write_figures
from analysis.load import Run, group_runs, short_names, sort_key, varying_fields
from moe_rl.trainer.compare import COLUMNS, run_row


def summary_table(groups: dict[str, list[Run]]) -> dict[str, dict[str, Any]]:
    """Per group: seeds, and each COLUMNS value averaged over seeds."""
    table = {}
    for label, runs in groups.items():
        rows = [run_row(r.rows) for r in runs]
        table[label] = {
            "seeds": [r.seed for r in runs],
            **{c: finite_mean([row[c] for row in rows]) for c in COLUMNS},
        }
    return table


def _events(run: Run) -> float:
    return float(run.rows[-1].get("collapse/events", 0.0))


def collapse_table(groups: dict[str, list[Run]]) -> dict[str, dict[str, Any]]:
    """Per group: seeds, seeds with a collapse event, their fraction, total events, event kinds."""
    table = {}
    for label, runs in groups.items():
        collapsed = [r for r in runs if _events(r) > 0]
        kinds: Counter[str] | None = Counter()
        for run in runs:
            if run.events is None:
                kinds = None
                break
            kinds.update(e["kind"] for e in run.events)
        table[label] = {
            "seeds": len(runs),
            "collapsed": len(collapsed),
            "frac": len(collapsed) / len(runs),
            "events": sum(_events(r) for r in runs),
            "kinds": None if kinds is None else dict(kinds),
        }
    return table


def collapse_by_field(runs: list[Run], field: str) -> str:
    """Markdown: collapsed seeds / seeds per value of `field` (rows) and base label (columns)."""
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    values, bases = {}, sorted({r.base_label for r in runs})
    for run in runs:
        value = run.flat.get(field)
        values[str(value)] = value
        cell = counts[(str(value), run.base_label)]
        cell[0] += _events(run) > 0
        cell[1] += 1
    order = sorted(values, key=lambda v: sort_key(values[v]))
    lines = [f"| {field} | " + " | ".join(bases) + " |", "|---" * (len(bases) + 1) + "|"]
    for v in order:
        cells = [f"{counts[(v, b)][0]}/{counts[(v, b)][1]}" if (v, b) in counts else "–" for b in bases]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_summary(table: dict[str, dict[str, Any]]) -> str:
    """Markdown, one row per group, numbers to 4 significant digits."""
    lines = ["| run | seeds | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for label, row in table.items():
        seeds = f"{len(row['seeds'])} ({', '.join(map(str, row['seeds']))})"
        lines.append(f"| {label} | {seeds} | " + " | ".join(f"{row[c]:.4g}" for c in COLUMNS) + " |")
    return "\n".join(lines)


def format_collapse(table: dict[str, dict[str, Any]]) -> str:
    """Markdown, one row per group."""
    lines = ["| run | seeds | seeds with collapse | fraction | events | kinds |", "|---" * 6 + "|"]
    for label, row in table.items():
        kinds = (
            "unknown"
            if row["kinds"] is None
            else ", ".join(f"{k}: {n}" for k, n in sorted(row["kinds"].items())) or "–"
        )
        lines.append(
            f"| {label} | {row['seeds']} | {row['collapsed']} | {row['frac']:.2f} | {row['events']:g} | {kinds} |"
        )
    return "\n".join(lines)


def write_report(runs: list[Run], out_dir: Path, title: str, sources: list[str]) -> Path:
    """Figures, tables (markdown and table.json) and report.md under out_dir; returns report.md's path."""
    if not runs:
        raise ValueError("no runs to analyse")
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = varying_fields(runs)
    groups = group_runs(runs, fields)
    summary, collapse = summary_table(groups), collapse_table(groups)
    figures = write_figures(groups, out_dir)
    summary_md, collapse_md = format_summary(summary), format_collapse(collapse)
    by_field = {f: collapse_by_field(runs, f) for f in fields}
    (out_dir / "summary_table.md").write_text(summary_md + "\n")
    (out_dir / "collapse_table.md").write_text("\n\n".join([collapse_md, *by_field.values()]) + "\n")
    (out_dir / "table.json").write_text(json.dumps({"summary": summary, "collapse": collapse}, indent=2))

    names = short_names(fields)
    varying = ", ".join(f"`{f}`" + (f" (shown as {names[f]})" if names[f] != f else "") for f in fields)
    parts = [
        f"# {title}",
        f"{len(runs)} runs in {len(groups)} groups, from: " + ", ".join(f"`{s}`" for s in sources) + ".",
        "Groups are labelled by objective preset and replay source from each run's config"
        + (
            f", and by the config fields that vary in this sweep: {varying}."
            if fields
            else "; no other config field varies."
        ),
        f"Curves are means over seeds; bands and error bars span the {BAND}.",
        "## Summary (mean over seeds)",
        "Per run: final reward = mean `rollout/reward/mean` over the last 5 steps; the other columns are means "
        "over steps of `clip/token_frac`, `ratio/token/var`, `routing/expert_change/frac`; collapse events = "
        "`collapse/events` at the last step. Full precision in [table.json](table.json).",
        summary_md,
        "## Collapse",
        collapse_md,
        *(f"Collapsed seeds / seeds by `{f}`:\n\n{md}" for f, md in by_field.items()),
        "## Figures",
    ]
    for name, (path, caption) in figures.items():
        parts.append(f"### {name.replace('_', ' ')}\n\n{caption}\n\n![{name}]({path.name})")
    report = out_dir / "report.md"
    report.write_text("\n\n".join(parts) + "\n")
    return report
