"""Markdown tables and the report page (report.md) that links every figure.

write_report walks SECTIONS (analysis.sections.Section): each section that applies to the sweep computes
its result once and contributes its text, its tables file, its table.json entries and its figures, in
the registry's order. The summary, collapse, step-size and pairs sections live here; the others with
their statistics (analysis.outcomes, drift, critical, steplr, offpolicy, engines).

Summary table, one row per group (base label + varying config fields), each cell the mean over
seeds ± the half-width of its 95% Student t confidence interval (analysis.stats.mean_ci) of the
per-run value that `moe-rl-compare` computes (analysis.compare.run_row):

| column | per run, from metrics.jsonl |
|---|---|
| final reward | mean of `rollout/reward/mean` over the last 5 steps |
| final eval acc | `eval/accuracy` of the last row that has it (left out when no run has held-out eval) |
| final expected acc | `eval/expected_accuracy` of the last row that has it (left out when no run has it) |
| clip frac | mean over steps of `clip/token_frac` |
| token-ratio var | mean over steps of `ratio/token/var` |
| expert change | mean over steps of `routing/expert_change/response_frac` (over response positions; `frac` for older runs) |
| collapse events | `collapse/events` at the run's last step |

Non-finite values are left out of every mean (and of n). table.json holds the same numbers at full
precision: per group the mean of each column, its CI half-width under "ci95", its n under "n", and
every seed's value under "per_seed" ({"seed": [...], column: [...]}, aligned), as every table in
table.json does, so any number can be re-derived per seed.

Collapse table: per group, the number of seeds with at least one collapse event (from the metrics'
`collapse/events`), their fraction with its 95% Wilson score interval, the total events and their
kinds (from events.jsonl; unknown for W&B runs). When config fields vary, a second table per field
gives collapsed seeds / seeds for each value and base label.

Volatility and step size (only when some run logged `routing/expert_change/after_one_update`): per
group the means over steps of the change after one update, the change the router margins predict and
the per-update KL and the load CV (STEP_COLUMNS), each mean ± 95% CI over seeds.

Expected accuracy over training (analysis.outcomes; only when some run logged
`eval/expected_accuracy`): per group the mean AUC of the expected-accuracy curve with its CI, and the
seeds with a sustained regression and when.

Each objective at its own step size (analysis.steplr; only when `trainer.lr` takes at least 3 values):
per pair of arms, the contrast at each shared lr, at each arm's own best lr (cross-fitted over two halves of
the seeds) and at matched per-update KL.

Pairwise differences (analysis.pairs): outcome and collapse-rate differences between groups that
differ only in objective / replay (and, with expected accuracy, the paired AUC difference and the
log-rank test of time to regression), with CIs, p-values and a verdict in words, under a sentence on the
sweep's warm-start design (analysis.clusters): "conditional on one warm start" when every run shares one;
with several warm starts each carrying RL seeds, also the contrast over warm starts with its
between-warm-start variance and ICC.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from analysis import (
    critical,
    drift,
    engines,
    factorial,
    offpolicy,
    outcomes,
    runtable,
    staleness,
    steplr,
    variants,
)
from analysis.clusters import detect_design
from analysis.compare import COLUMNS, format_cell, shown_columns
from analysis.figures import BAND, write_figures
from analysis.load import Run, group_runs, short_names, sort_key, varying_fields
from analysis.pairs import check_pairs, format_pairs, pairwise
from analysis.sections import Figures, Section, Sweep
from analysis.stats import CI_NOTE, mean_ci, wilson


def summary_table(groups: dict[str, list[Run]]) -> dict[str, dict[str, Any]]:
    """Per group: seeds, each COLUMNS value averaged over seeds, its 95% CI half-width ("ci95") and n ("n")."""
    table = {}
    for label, runs in groups.items():
        rows = [r.summary() for r in runs]
        cis = {c: mean_ci([row[c] for row in rows]) for c in COLUMNS}
        table[label] = {
            "seeds": [r.seed for r in runs],
            **{c: ci.mean for c, ci in cis.items()},
            "ci95": {c: ci.half for c, ci in cis.items()},
            "n": {c: ci.n for c, ci in cis.items()},
            "per_seed": {"seed": [r.seed for r in runs], **{c: [row[c] for row in rows] for c in COLUMNS}},
        }
    return table


def _events(run: Run) -> float:
    return run.last("collapse/events", 0.0)


def collapse_table(groups: dict[str, list[Run]]) -> dict[str, dict[str, Any]]:
    """Per group: seeds, seeds with a collapse event, their fraction and its 95% Wilson interval, total events, event kinds."""
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
            "frac_ci95": wilson(len(collapsed), len(runs)),
            "events": sum(_events(r) for r in runs),
            "kinds": None if kinds is None else dict(kinds),
            "per_seed": {"seed": [r.seed for r in runs], "events": [_events(r) for r in runs]},
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
    """Markdown, one row per group: mean ± 95% CI half-width (n noted where a seed lacks the value)."""
    columns = shown_columns(table)
    lines = ["| run | seeds | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for label, row in table.items():
        seeds = f"{len(row['seeds'])} ({', '.join(map(str, row['seeds']))})"
        cells = [
            format_cell(row[c], row["ci95"][c])
            + (f" (n={row['n'][c]})" if 0 < row["n"][c] < len(row["seeds"]) else "")
            for c in columns
        ]
        lines.append(f"| {label} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nCells: {CI_NOTE}."


STEP_COLUMNS = {
    "change after one update": "routing/expert_change/after_one_update",
    "change predicted by the margins": "routing/margin/predicted_change",
    "per-update KL": "policy/approx_kl",
    "load CV": "routing/load_cv/mean",
}
"""Step-size and volatility table: column -> the per-step metric averaged over each run's steps."""


def step_table(groups: dict[str, list[Run]]) -> dict[str, dict[str, Any]]:
    """Per group: each STEP_COLUMNS metric's mean over steps, averaged over seeds (mean, 95% CI half, n),
    with every seed's value; empty when no run logged the change after one update."""
    if not any("routing/expert_change/after_one_update" in r.keys() for rs in groups.values() for r in rs):
        return {}
    table = {}
    for label, runs in groups.items():
        per_seed = {c: [r.mean(k) for r in runs] for c, k in STEP_COLUMNS.items()}
        cis = {c: mean_ci(v) for c, v in per_seed.items()}
        table[label] = {"seeds": [r.seed for r in runs], **{c: ci.mean for c, ci in cis.items()},
                        "ci95": {c: ci.half for c, ci in cis.items()}, "n": {c: ci.n for c, ci in cis.items()},
                        "per_seed": {"seed": [r.seed for r in runs], **per_seed}}  # fmt: skip
    return table


def format_step(table: dict[str, dict[str, Any]]) -> str:
    """Markdown, one row per group: the change after one update (%), its prediction, the per-update KL, the load CV."""
    lines = ["| run | seeds | " + " | ".join(STEP_COLUMNS) + " |", "|---" * (len(STEP_COLUMNS) + 2) + "|"]
    for label, row in table.items():
        cells = []
        for c in STEP_COLUMNS:
            mean, half = row[c], row["ci95"][c]
            if "change" in c:
                cells.append(f"{100 * mean:.2f}%" + (f" ± {100 * half:.2f}%" if math.isfinite(half) else ""))
            else:
                cells.append(f"{mean:.2g}" + (f" ± {half:.1g}" if math.isfinite(half) else ""))
        lines.append(f"| {label} | {len(row['seeds'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_collapse(table: dict[str, dict[str, Any]]) -> str:
    """Markdown, one row per group."""
    lines = [
        "| run | seeds | seeds with collapse | fraction | 95% CI (Wilson) | events | kinds |",
        "|---" * 7 + "|",
    ]
    for label, row in table.items():
        kinds = (
            "unknown"
            if row["kinds"] is None
            else ", ".join(f"{k}: {n}" for k, n in sorted(row["kinds"].items())) or "–"
        )
        lines.append(
            f"| {label} | {row['seeds']} | {row['collapsed']} | {row['frac']:.2f} "
            f"| [{row['frac_ci95'][0]:.2f}, {row['frac_ci95'][1]:.2f}] | {row['events']:g} | {kinds} |"
        )
    return "\n".join(lines)


SUMMARY_INTRO = (
    "Per run: final reward = mean `rollout/reward/mean` over the last 5 steps; final eval acc = the last "
    "logged `eval/accuracy` (held-out eval; the column is left out when no run has it); final expected acc = the "
    "last logged `eval/expected_accuracy` (likewise); the other columns "
    "are means over steps of `clip/token_frac`, `ratio/token/var`, `routing/expert_change/response_frac`; collapse "
    "events = `collapse/events` at the last step. Full precision in [table.json](table.json)."
)
STEP_INTRO = (
    "Per run, the mean over steps of `routing/expert_change/after_one_update` "
    "(mini-batch 2 against the old policy: the paper's per-update quantity), `routing/margin/predicted_change` "
    "(what the router margins predict for the update's logit shift), `policy/approx_kl` (the per-update "
    "KL) and `routing/load_cv/mean` (the experts' load imbalance, coefficient of variation over experts); "
    "mean ± 95% CI over seeds."
)


def collapse_section(sweep: Sweep) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The collapse table and, per varying field, its collapsed seeds / seeds by value."""
    return collapse_table(sweep.groups), {f: collapse_by_field(sweep.runs, f) for f in sweep.fields}


def pairs_section(sweep: Sweep) -> tuple[list[dict[str, Any]], Any]:
    """The pairwise differences, with the sweep's warm-start design their table opens with."""
    return pairwise(sweep.groups, sweep.fields, sweep.permutations, extra=sweep.pairs), detect_design(sweep.runs)


SUMMARY = Section(name="summary", heading="Summary (mean ± 95% CI over seeds)", intro=SUMMARY_INTRO,
                  file="summary_table.md", compute=lambda sweep: summary_table(sweep.groups), markdown=format_summary)
STEP = Section(name="step_size", heading="Volatility and step size", intro=STEP_INTRO,
               compute=lambda sweep: step_table(sweep.groups) or None, markdown=format_step)
COLLAPSE = Section(
    name="collapse", heading="Collapse", file="collapse_table.md", compute=collapse_section,
    markdown=lambda r: "\n\n".join([format_collapse(r[0]), *r[1].values()]),
    body=lambda r: "\n\n".join([format_collapse(r[0]),
                                 *(f"Collapsed seeds / seeds by `{f}`:\n\n{md}" for f, md in r[1].items())]),
    json=lambda r: {"collapse": r[0]},
)
PAIRS = Section(name="pairs", heading="Pairwise differences", file="pairs_table.md", compute=pairs_section,
                markdown=lambda r: format_pairs(*r), json=lambda r: {"pairs": r[0]})  # fmt: skip

SECTIONS: tuple[Section, ...] = (
    SUMMARY, outcomes.SECTION, STEP, COLLAPSE, drift.SECTION, factorial.SECTION, staleness.SECTION,
    critical.SECTION, steplr.SECTION, offpolicy.SECTION, engines.SECTION, variants.SECTION, PAIRS,
)
"""The report's sections in report.md's order (and table.json's); each applies or is left out."""


def tabled_note(left_out: list[str]) -> str:
    """report.md's sentence on what a report made from per-run tables leaves out."""
    what = "the figures of per-step curves" + "".join(f" and the section \"{h}\"" for h in left_out)
    return (f"Read from per-run tables (analysis.runtable), which keep no per-step curve: {what} "
            "are left out (`moe-rl-archive fetch` the sweep's records for them).")


def write_report(
    runs: list[Run],
    out_dir: Path,
    title: str,
    sources: list[str],
    smooth: float = 0.0,
    permutations: int = 10_000,
    sections: tuple[Section, ...] = SECTIONS,
    pairs: tuple[tuple[str, str], ...] = (),
) -> Path:
    """Figures, tables (markdown and table.json), the per-run table (runs.parquet, analysis.runtable) and
    report.md under out_dir; returns report.md's path. From runs read back from a per-run table, the
    sections that read per-step curves (`Section.steps`) and the curve figures are left out, and said so.

    smooth: EMA weight for the curves (0 = none; analysis.stats.ema); permutations: the collapse-rate
    permutation test's budget (exact below it, seeded random splits above); sections: the registry to
    walk (analysis.sections); pairs: pairs of group labels compared besides those that share every varying
    field (analysis.pairs.pairwise; ValueError before any work when a label is not a group).
    """
    if not runs:
        raise ValueError("no runs to analyse")
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = varying_fields(runs)
    groups = group_runs(runs, fields)
    check_pairs(groups, tuple(pairs))
    sweep = Sweep(runs, fields, groups, permutations, smooth, tuple(pairs))
    tabled = any(run.reduced is not None for run in runs)
    left_out = [s.heading for s in sections if tabled and s.steps and s.applies(sweep)]
    done = [(s, r) for s in sections if not (tabled and s.steps) and s.applies(sweep)
            and (r := s.compute(sweep)) is not None]
    lead: Figures = {}
    rest: Figures = {}
    for section, result in done:
        (lead if section.lead else rest).update(section.figures(result, out_dir))
    figures = {**lead, **write_figures(groups, out_dir, smooth=smooth, steps=not tabled), **rest}
    table: dict[str, Any] = {}
    for section, result in done:
        if section.file and section.markdown(result) not in section.report_text(result):
            (out_dir / section.file).write_text(section.markdown(result) + "\n")  # else report.md holds it
        table.update(section.entries(result))
    (out_dir / "table.json").write_text(json.dumps(table, separators=(",", ":")))  # compact: it is read by code
    runtable.write_table(runs, out_dir / runtable.FILE)

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
        f"Curves are means over seeds; bands and error bars are the {BAND}."
        + (
            f" Curves are smoothed per seed by an EMA of weight {smooth:g} (raw mean drawn faint behind)."
            if smooth
            else ""
        ),
        *([tabled_note(left_out)] if tabled else []),
        *(text for section, result in done if (text := section.report_text(result))),
        "## Figures",
    ]
    for name, (path, caption) in figures.items():
        parts.append(f"### {name.replace('_', ' ')}\n\n{caption}\n\n![{name}]({path.name})")
    report = out_dir / "report.md"
    report.write_text("\n\n".join(parts) + "\n")
    return report
