"""The drift dose-response: outcome against measured expert change when `routing.drift` is swept.

One row per objective arm (base label) and drift p. Per run:

| quantity | per run |
|---|---|
| expert change | mean over steps of `routing/expert_change/response_frac`: the change the update forwards saw, injected drift included (x of the phase diagram) |
| final eval acc | `eval/accuracy` of the last row that has it |
| collapsed | any collapse event (`collapse/events` > 0 at the last step); the kinds come from events.jsonl |
| token-ratio var, clip frac | means over steps of `ratio/token/var`, `clip/token_frac` |

Cells are mean ± 95% t-CI over seeds; the collapse rate carries its 95% Wilson interval.

Replay arms (routing.replay ≠ off) ignore drift: replay wins, and the same seed gives bitwise-identical
runs at every p (tests/test_train.py). Their runs at one p therefore stand for every p; the table
compares each drifting arm at each p with the first replay arm (the reference): the eval-accuracy
difference, paired by seed when both cells ran the same seeds (a seed's warm start and eval set are
shared by every arm, so pairing removes the between-seed spread; `paired_t`), else Welch's; the
collapse-rate difference with its Newcombe CI and permutation p-value; a verdict in words
(analysis.stats.verdict). Where runs logged `eval/expected_accuracy` (analysis.outcomes), the table adds
each cell's expected-accuracy AUC, its paired difference to the reference, and the log-rank test of
time to sustained regression against the reference's runs (one per seed).

The dose trend: within each seed, the least-squares slope of the outcome (final eval accuracy minus
the reference's at that seed; and the expected-acc AUC, where logged) on the run's measured expert
change, per 10 percentage points of change; then a one-sample t-test over the seeds' slopes
(`slope_over_seeds`). A seed's runs share its warm start, eval set and reference, so they are not
independent: the seed, not the run, is the unit. The phase diagram draws the reference as a
horizontal band across the whole x range. table.json keeps every seed's values and slopes.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from analysis.figures import BAND, _colors, _finish  # noqa: E402
from analysis.load import Run  # noqa: E402
from analysis.outcomes import auc, format_regression, has_expected, regression_test  # noqa: E402
from analysis.pairs import collapsed, final_eval, outcome_difference  # noqa: E402
from analysis.stats import mean_ci, rate_difference, slope_over_seeds, verdict, wilson  # noqa: E402
from moe_rl.trainer.compare import run_row  # noqa: E402

FIELD = "routing.drift"
PAPER_CHANGE = 0.10
"""The GSPO paper's ~10% of activated experts changing per update (48-layer Qwen3-30B-A3B, section 5.3)."""

Groups = dict[str, list[Run]]
CAPTION = (
    "Final held-out eval accuracy (left) and collapse rate (right) against the measured expert change per "
    "update, one line per drifting arm (points labelled with their drift p), the replay arm as a dashed "
    "line with its band; the dotted line marks the GSPO paper's ~10%."
)


def _kinds(runs: list[Run]) -> dict[str, int] | None:
    if any(r.events is None for r in runs):
        return None
    kinds: dict[str, int] = {}
    for run in runs:
        for kind in {e["kind"] for e in run.events}:  # seeds with the kind, not events
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _outcome_collapsed(runs: list[Run]) -> int | None:
    """Seeds with an event other than ratio_blowup (reward or entropy collapse, non-finite updates): the
    training outcome failing, not only a ratio extreme; None when a run's events are unknown (W&B)."""
    if any(r.events is None for r in runs):
        return None
    return sum(any(e["kind"] != "ratio_blowup" for e in r.events) for r in runs)


def _is_replay(runs: list[Run]) -> bool:
    return runs[0].config["routing"]["replay"] != "off"


def dose_table(groups: Groups, permutations: int = 10_000) -> list[dict[str, Any]]:
    """One dict per (arm, p), arms in group order, p ascending: seeds, the module's quantities (mean, CI
    half, n), collapsed seeds with their Wilson interval and kinds, and `vs_reference` (None for the
    reference arm itself or when no replay arm ran)."""
    by_arm: dict[str, dict[float, list[Run]]] = {}
    for runs in groups.values():
        by_arm.setdefault(runs[0].base_label, {})[float(runs[0].flat[FIELD])] = runs
    reference = next((arm for arm, cells in by_arm.items() if _is_replay(next(iter(cells.values())))), None)
    ref_runs = [r for cell in by_arm.get(reference, {}).values() for r in cell]
    out = []
    for arm, cells in by_arm.items():
        for p in sorted(cells):
            runs = cells[p]
            rows = [run_row(r.rows) for r in runs]
            k, n = sum(collapsed(r) for r in runs), len(runs)
            per_seed = {
                "seed": [r.seed for r in runs], "expert change": [x["expert change"] for x in rows],
                "final eval acc": [final_eval(r) for r in runs], "token-ratio var": [x["token-ratio var"] for x in rows],
                "clip frac": [x["clip frac"] for x in rows], "expected-acc AUC": [auc(r) for r in runs],
                "collapsed": [collapsed(r) for r in runs],
            }  # fmt: skip
            row = {
                "arm": arm, "drift": p, "seeds": per_seed["seed"], "replay": _is_replay(runs),
                **{q: mean_ci(per_seed[q]) for q in QUANTITIES},
                "collapsed": k, "collapse wilson": wilson(k, n), "kinds": _kinds(runs),
                "outcome collapsed": _outcome_collapsed(runs),
                "vs_reference": None, "per_seed": per_seed,
            }  # fmt: skip
            if reference is not None and arm != reference:
                row["vs_reference"] = _versus(runs, ref_runs, permutations)
            out.append(row)
    return out


QUANTITIES = ("expert change", "final eval acc", "token-ratio var", "clip frac", "expected-acc AUC")


def _one_per_seed(runs: list[Run]) -> list[Run]:
    """The first run of each seed: the reference's runs at every p are the same run (replay wins)."""
    first: dict[int, Run] = {}
    for run in runs:
        first.setdefault(run.seed, run)
    return list(first.values())


def dose_trend(groups: Groups) -> dict[str, dict[str, dict[str, Any]]]:
    """Per drifting arm and outcome ("final eval acc", and "expected-acc AUC" where logged): the mean over
    seeds of each seed's slope of (outcome - the reference's, same seed) on measured expert change, per 10
    percentage points, with a one-sample t-test over those slopes: {"slope": Difference (n = seeds),
    "per_seed": {seed: slope}}. Only seeds the reference ran count. Subtracting the reference shifts a
    seed's points without changing its slope; it keeps the y axis that of the dose table's differences."""
    arms: dict[str, list[Run]] = {}
    for runs in groups.values():
        arms.setdefault(runs[0].base_label, []).extend(runs)
    reference = next((arm for arm, runs in arms.items() if _is_replay(runs)), None)
    if reference is None:
        return {}
    ref_runs = _one_per_seed(arms[reference])
    outcomes = {"final eval acc": final_eval, **({"expected-acc AUC": auc} if has_expected(ref_runs) else {})}
    out = {}
    for arm, runs in arms.items():
        if _is_replay(runs):
            continue
        out[arm] = {}
        for name, outcome in outcomes.items():
            ref = {r.seed: outcome(r) for r in ref_runs}
            x: dict[int, list[float]] = {}
            y: dict[int, list[float]] = {}
            for r in runs:
                if r.seed in ref:
                    x.setdefault(r.seed, []).append(run_row(r.rows)["expert change"] / 0.1)
                    y.setdefault(r.seed, []).append(outcome(r) - ref[r.seed])
            slope, per_seed = slope_over_seeds(x, y)
            out[arm][name] = {"slope": slope, "per_seed": per_seed}
    return out


def format_trend(trend: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: one line per drifting arm and outcome."""
    lines = ["| arm | outcome | seeds | Δ per +10 points of expert change: mean of per-seed slopes (95% CI) | p "
             "| verdict |", "|---" * 6 + "|"]
    for arm, by_outcome in trend.items():
        for name, t in by_outcome.items():
            d = t["slope"]
            ci = f"[{d.lo:+.3f}, {d.hi:+.3f}]" if math.isfinite(d.lo) else ""
            lines.append(f"| {arm} | {name} | {d.n_a} | {d.diff:+.3f} {ci} | {d.p:.2g} | {_short(verdict(d))} |")
    return "\n".join(lines)


def trend_json(trend: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The dose trend as plain JSON values (seeds as string keys)."""
    return {arm: {name: {"slope": dataclasses.asdict(t["slope"]), "per_seed": {str(k): v for k, v in t["per_seed"].items()}}
                  for name, t in by_outcome.items()} for arm, by_outcome in trend.items()}  # fmt: skip


def _versus(a: list[Run], b: list[Run], permutations: int) -> dict[str, Any]:
    acc = outcome_difference(a, b)
    rate = rate_difference([collapsed(r) for r in a], [collapsed(r) for r in b], permutations)
    out = {"acc": acc, "acc verdict": _short(verdict(acc)), "rate": rate, "rate verdict": _short(verdict(rate)),
           "auc": None, "auc verdict": None, "regression": None}  # fmt: skip
    if has_expected(a + b):
        one = _one_per_seed(b)
        out["auc"] = outcome_difference(a, one, auc)
        out["auc verdict"] = _short(verdict(out["auc"]))
        out["regression"] = regression_test(a, one)
    return out


def _short(sentence: str) -> str:
    """The verdict without its parenthesis (the table shows the CI and p beside it)."""
    return sentence.split(" (", 1)[0]


def dose_json(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table as plain JSON values (each mean with its CI half-width and n, each difference whole)."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return dataclasses.asdict(v)
        return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v

    return [plain(row) for row in table]


def _fmt_diff(d) -> str:
    if not math.isfinite(d.diff):
        return "n/a"
    ci = f" [{d.lo:+.3f}, {d.hi:+.3f}]" if math.isfinite(d.lo) else ""
    p = f", p = {d.p:.2g}" if math.isfinite(d.p) else ""
    return f"{d.diff:+.3f}{ci}{p}"


def format_dose(table: list[dict[str, Any]]) -> str:
    """Markdown: one line per (arm, p), then the comparison with the replay reference."""
    reference = next((r["arm"] for r in table if r["replay"]), None)
    lines = [
        "| arm | drift p | seeds | expert change | final eval acc | collapsed seeds (Wilson 95%) | kinds (seeds) "
        "| token-ratio var | clip frac |",
        "|---" * 9 + "|",
    ]
    for r in table:
        lo, hi = r["collapse wilson"]
        kinds = "unknown" if r["kinds"] is None else ", ".join(f"{k}: {v}" for k, v in sorted(r["kinds"].items()))
        lines.append(
            f"| {r['arm']} | {r['drift']:g}" + (" (any: replay wins)" if r["replay"] else "")
            + f" | {len(r['seeds'])} | {_pct(r['expert change'])} | {r['final eval acc'].format()} "
            f"| {r['collapsed']}/{len(r['seeds'])} [{lo:.2f}, {hi:.2f}] | {kinds or '–'} "
            f"| {r['token-ratio var'].format(3)} | {r['clip frac'].format(3)} |"
        )
    if reference is None:
        return "\n".join(lines)
    lines += [
        "",
        f"Against the replay reference **{reference}** (its runs stand for every p): difference in final eval "
        "accuracy (95% CI and p of a paired t-test over seeds, or Welch's when the seeds differ) and in "
        "collapse rate (Newcombe 95% CI, permutation p).",
        "",
        "| arm | drift p | Δ eval acc | verdict | Δ collapse rate | verdict |",
        "|---" * 6 + "|",
    ]
    for r in table:
        v = r["vs_reference"]
        if v is not None:
            lines.append(
                f"| {r['arm']} | {r['drift']:g} | {_fmt_diff(v['acc'])} | {v['acc verdict']} "
                f"| {_fmt_diff(v['rate'])} | {v['rate verdict']} |"
            )
    return "\n".join(lines + _expected_lines(table, reference))


def _expected_lines(table: list[dict[str, Any]], reference: str) -> list[str]:
    """The expected-accuracy outcomes per cell against the reference; none when no run logged them."""
    if not any(r["expected-acc AUC"].n for r in table):
        return []
    lines = [
        "",
        f"Expected accuracy (analysis.outcomes): each cell's AUC (mean teacher-forced expected accuracy over "
        f"training), its difference to **{reference}** (paired by seed), and the log-rank test of time to "
        "sustained regression (below 0.8 x the pre-update value at two evals in a row) against the reference.",
        "",
        "| arm | drift p | expected-acc AUC | Δ AUC | verdict | time to regression |",
        "|---" * 6 + "|",
    ]
    for r in table:
        v = r["vs_reference"]
        cells = ("reference", "", "") if v is None or v["auc"] is None else (
            _fmt_diff(v["auc"]), v["auc verdict"], format_regression(v["regression"]))
        lines.append(f"| {r['arm']} | {r['drift']:g} | {r['expected-acc AUC'].format(3)} | " + " | ".join(cells) + " |")
    return lines


def _pct(ci) -> str:
    if ci.n == 0:
        return "n/a"
    half = f" ± {100 * ci.half:.2g}%" if math.isfinite(ci.half) else ""
    return f"{100 * ci.mean:.3g}%{half}"


def plot_phase_diagram(groups: Groups, table: list[dict[str, Any]], out_dir: Path) -> Path:
    """Against measured expert change (log x): final eval accuracy, its paired difference to the replay
    reference, and the collapse rate (any event; dotted: reward, entropy or non-finite events only), one
    line per drifting arm with its band; the reference as a horizontal band; the paper's ~10%."""
    colors = _colors({r["arm"]: None for r in table})
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    xs = [r["expert change"].mean for r in table if math.isfinite(r["expert change"].mean)]
    x_lo, x_hi = min([0.005, *xs]) / 1.3, max([0.2, *xs]) * 1.3
    for arm in dict.fromkeys(r["arm"] for r in table):
        rows = [r for r in table if r["arm"] == arm]
        acc = _band(rows, lambda r: (r["final eval acc"].mean, r["final eval acc"].lo, r["final eval acc"].hi))
        rate = _band(rows, lambda r: (r["collapsed"] / len(r["seeds"]), *r["collapse wilson"]))
        color = colors[arm]
        if rows[0]["replay"]:
            label = f"{arm}: any drift (replay wins)"
            for ax, (m, lo, hi) in zip(axes, (acc[0], (0.0, 0.0, 0.0), rate[0]), strict=True):
                ax.axhline(m, color=color, linestyle="--", label=label)
                ax.axhspan(lo, hi, color=color, alpha=0.12, linewidth=0)
            continue
        x = np.array([r["expert change"].mean for r in rows])
        diff = _band(rows, lambda r: (r["vs_reference"]["acc"].diff, r["vs_reference"]["acc"].lo,
                                      r["vs_reference"]["acc"].hi) if r["vs_reference"] else (math.nan,) * 3)
        for ax, y in zip(axes, (acc, diff, rate), strict=True):
            ax.plot(x, y[:, 0], color=color, marker="o", label=arm)
            ax.fill_between(x, y[:, 1], y[:, 2], color=color, alpha=0.2, linewidth=0)
        outcome = [r["outcome collapsed"] for r in rows]
        if all(k is not None for k in outcome):
            axes[2].plot(x, [k / len(r["seeds"]) for k, r in zip(outcome, rows, strict=True)], color=color,
                         linestyle=":", marker="x", label=f"{arm}: reward, entropy or non-finite events only")
    ylabels = ("final held-out eval accuracy", "Δ final eval accuracy vs the replay arm\n(same seed; paired 95% CI)",
               "collapse rate (seeds with an event)")
    for ax, ylabel in zip(axes, ylabels, strict=True):
        ax.set_xscale("log")
        ax.set_xlim(x_lo, x_hi)
        ax.axvline(PAPER_CHANGE, color="grey", linestyle=":", label="GSPO paper: ~10% per update")
        ax.set_xlabel("measured expert change per update (response tokens, log scale)")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{100 * v:g}%"))
    axes[2].set_ylim(-0.02, 1.02)
    doses: dict[float, list[float]] = {}
    for r in table:
        if not r["replay"] and math.isfinite(r["expert change"].mean):
            doses.setdefault(r["drift"], []).append(r["expert change"].mean)
    for p, x in doses.items():  # each injected p at the mean change its arms measured
        axes[0].annotate(f"p={p:g}", (float(np.mean(x)), 1), xytext=(0, -10), textcoords="offset points",
                         xycoords=("data", "axes fraction"), fontsize="x-small", color="grey", ha="center")
    return _finish(fig, axes, out_dir / "phase_diagram.png",
                   f"Drift dose-response (bands: accuracy {BAND}; collapse rate Wilson 95%)")


def _band(rows: list[dict[str, Any]], stats) -> np.ndarray:
    """[cells, 3] (value, low, high); a cell without an interval (one seed) gets a zero-width band."""
    out = np.array([stats(r) for r in rows], dtype=float)
    missing = ~np.isfinite(out[:, 1])
    out[missing, 1:] = out[missing, :1]
    return out
