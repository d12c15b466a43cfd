"""Expert change against staleness: how far the stale sampler's routing is from the proximal policy's.

Under `rollout.staleness` = k, step t trains on rollouts that the weights of step t − s sampled, s being
the step's `staleness/mean` in versions (the deterministic sampler gives s = t for the first k steps,
then k; the overlapped one anywhere in 0..k, a step's mean rounded to a whole version). Each step of a
run is binned by its s; per run and bin, the mean over the bin's steps of:

| column | metric |
|---|---|
| change vs sampler | `routing/expert_change/vs_sampler`: 1 − \\|A∩B\\|/K, the sampler's experts against the proximal forward's free top-k on the same response positions |
| margin prediction | `routing/margin/predicted_change_vs_sampler`: the change the proximal router margins predict at the measured logit shift |
| logit shift | `routing/logit_shift/vs_sampler`: centred RMS shift of the router logits from sampler to proximal |
| log-prob mismatch | `mismatch/logp_abs_diff/mean`: mean \\|log π_sampler − log π_proximal\\| over response tokens, as the objective sees it |

Two views, per arm (the group label without rollout.staleness), which are not pooled because they
describe different policies. "Warm-up" takes the arm's runs at its largest k = K and their first K steps,
where step t trains on the initial policy's rollouts (s = t): the change after s = 0 .. K − 1 versions of
training from the start, within the same runs. "By k" is each run's steady state (its steps with s = k,
the rest of the run) per level of rollout.staleness. A version is one RL step, trainer.mini_batches
optimizer updates. A cell is the mean ± 95% t half-width over units: warm starts (each the mean over
its RL seeds) in a sweep over several warm starts with RL seeds on each (analysis.clusters), else runs.

Growth: per arm, the steady-state change vs sampler at the highest k less at the lowest k > 0, paired
within (warm start, RL seed) and judged by a t over warm starts (analysis.clusters.cluster_contrast),
with σ² between and the ICC. The section applies when a run logged `routing/expert_change/vs_sampler`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from analysis.clusters import CLUSTERED, MIN_WARM_STARTS, cluster_contrast, detect_design, warm_start_id
from analysis.load import Run, group_label
from analysis.plotting import band_plot, finish, group_colors, plt
from analysis.sections import Figures, Section, Sweep, doc_intro
from analysis.stats import MIN_SEEDS, mean_ci, verdict

FIELD = "rollout.staleness"
STALENESS = "staleness/mean"
CHANGE = "routing/expert_change/vs_sampler"
COLUMNS = {
    "change vs sampler": CHANGE,
    "margin prediction": "routing/margin/predicted_change_vs_sampler",
    "logit shift": "routing/logit_shift/vs_sampler",
    "log-prob mismatch": "mismatch/logp_abs_diff/mean",
}
PAPER_CHANGE = 0.10
"""The GSPO paper's "about 10% of the activated experts change after one update" (a 48-layer 30B-A3B model)."""


def applies(sweep: Sweep) -> bool:
    return any(CHANGE in run.keys() for run in sweep.runs)


def binned(run: Run) -> dict[int, dict[str, float]]:
    """{s: {column: the mean over the run's steps at staleness s}}; steps without `staleness/mean` are s = 0."""
    s_T = np.rint(np.nan_to_num(run.series(STALENESS), nan=0.0)).astype(int)
    out: dict[int, dict[str, float]] = {}
    values = {name: run.series(key) for name, key in COLUMNS.items()}
    for s in np.unique(s_T):
        at = s_T == s
        row = {}
        for name, v_T in values.items():
            v = v_T[at & np.isfinite(v_T)]
            row[name] = float(v.mean()) if v.size else math.nan
        row["steps"] = float(at.sum())
        out[int(s)] = row
    return out


def _unit_means(values: dict[Any, list[float]], clustered: bool) -> list[float]:
    """The values a cell's interval runs over: one per warm start (mean over its seeds) or one per run."""
    if not clustered:
        return [v for vs in values.values() for v in vs]
    return [float(np.nanmean(vs)) for vs in values.values() if np.isfinite(vs).any()]


def _cell(per_unit: dict[Any, list[float]], clustered: bool) -> dict[str, float]:
    m = mean_ci(_unit_means(per_unit, clustered))
    return {"mean": m.mean, "ci95": m.half, "n": m.n}


def staleness_table(sweep: Sweep) -> dict[str, Any] | None:
    """By staleness, by k and the growth contrasts (module docstring); None when no run logged the change."""
    runs = [run for run in sweep.runs if CHANGE in run.keys()]
    if not runs:
        return None
    clustered = detect_design(sweep.runs).kind == CLUSTERED
    others = [f for f in sweep.fields if f != FIELD]
    # {arm: {s: {column: {warm start (or run): [values]}}}} and {arm: {k: {column: {...}}}}
    by_s: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    by_k: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    steady: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))  # arm -> k -> ws -> {seed: change}
    steps: dict = defaultdict(lambda: defaultdict(float))
    top: dict[str, int] = defaultdict(int)  # each arm's largest k
    for run in runs:
        top[group_label(run, others)] = max(top[group_label(run, others)], int(run.flat.get(FIELD) or 0))
    for run in runs:
        arm, k = group_label(run, others), int(run.flat.get(FIELD) or 0)
        cluster = warm_start_id(run) if clustered else (warm_start_id(run), run.seed)
        bins = binned(run)
        if k == top[arm]:
            for s, row in bins.items():
                if s < k:
                    steps[arm][s] += row["steps"]
                    for name in COLUMNS:
                        by_s[arm][s][name][cluster].append(row[name])
        if k in bins:
            for name in COLUMNS:
                by_k[arm][k][name][cluster].append(bins[k][name])
            steady[arm][k][warm_start_id(run)][run.seed] = bins[k]["change vs sampler"]
    result: dict[str, Any] = {"clustered": clustered, "warmup_k": dict(top), "by_staleness": {}, "by_k": {},
                              "growth": []}
    for arm in by_k:
        result["by_staleness"][arm] = {
            int(s): {"steps": steps[arm][s], **{name: _cell(by_s[arm][s][name], clustered) for name in COLUMNS}}
            for s in sorted(by_s[arm])}
        result["by_k"][arm] = {int(k): {name: _cell(by_k[arm][k][name], clustered) for name in COLUMNS}
                               for k in sorted(by_k[arm])}
        levels = sorted(k for k in steady[arm] if k > 0)
        if len(levels) >= 2:
            low, high = levels[0], levels[-1]
            c = cluster_contrast(steady[arm][high], steady[arm][low])
            unit, least = ("warm start(s)", MIN_WARM_STARTS) if clustered else ("seed(s)", MIN_SEEDS)
            result["growth"].append({
                "arm": arm, "high": high, "low": low, "diff": c.diff, "lo": c.lo, "hi": c.hi, "p": c.p,
                "clusters": c.warm_starts, "runs": c.runs, "var_between": c.var_between, "icc": c.icc,
                "verdict": verdict(c.difference(), min_seeds=least).replace("seed(s)", unit)})
    return result


def _fmt(cell: dict[str, float], scale: float = 1.0, digits: int = 3) -> str:
    if not cell["n"] or not math.isfinite(cell["mean"]):
        return "n/a"
    half = "–" if not math.isfinite(cell["ci95"]) else f"{cell['ci95'] * scale:.2g}"
    return f"{cell['mean'] * scale:.{digits}g} ± {half}"


def _pct(cell: dict[str, float]) -> str:
    text = _fmt(cell, 100.0)
    return text if text == "n/a" else text.replace(" ±", "% ±")


def format_staleness(result: dict[str, Any]) -> str:
    unit = "warm starts" if result["clustered"] else "runs"
    head = "| {} | {} | change vs sampler | margin prediction | logit shift | log-prob mismatch | {} |"
    rule = "|---" * 7 + "|"
    parts = [f"Warm-up: the first K steps of each arm's runs at its largest k = K, where step t trains on the initial "
             f"policy's rollouts (s = t versions between sampler and trainer; 95% t over {unit})",
             "\n".join([head.format("arm", "s", "steps"), rule] + [
                 f"| {arm} | {s} | {_pct(row['change vs sampler'])} | {_pct(row['margin prediction'])} "
                 f"| {_fmt(row['logit shift'])} | {_fmt(row['log-prob mismatch'])} | {row['steps']:g} |"
                 for arm, rows in result["by_staleness"].items() for s, row in rows.items()]),
             f"By k = {FIELD}, each run's steady state (its steps at s = k; 95% t over {unit})",
             "\n".join([head.format("arm", "k", unit), rule] + [
                 f"| {arm} | {k} | {_pct(row['change vs sampler'])} | {_pct(row['margin prediction'])} "
                 f"| {_fmt(row['logit shift'])} | {_fmt(row['log-prob mismatch'])} | {row['change vs sampler']['n']} |"
                 for arm, rows in result["by_k"].items() for k, row in rows.items()])]
    if result["growth"]:
        lines = [f"| arm | contrast | estimate (points) | 95% CI | p | {unit} | σ² between | ICC |", "|---" * 8 + "|"]
        words = []
        for g in result["growth"]:
            what = f"change vs sampler, k={g['high']} − k={g['low']}"
            lines.append(f"| {g['arm']} | {what} | {100 * g['diff']:+.3g} | [{100 * g['lo']:.3g}, {100 * g['hi']:.3g}] "
                         f"| {g['p']:.3g} | {g['clusters']} | {g['var_between']:.3g} | {g['icc']:.2f} |")
            words.append(f"- {g['arm']}, {what}: {100 * g['diff']:+.3g} points: {g['verdict']}.")
        parts += ["Growth with k (steady states paired within a unit)", "\n".join(lines), "\n".join(words)]
    return "\n\n".join(parts)


def plot_staleness(result: dict[str, Any], out_dir: Path) -> Figures:
    """Change vs sampler and the log-prob mismatch against s, per arm: the warm-up curve (lines, the margin
    prediction dotted) and each k's steady state (squares with error bars)."""
    arms = list(result["by_staleness"])
    colors = group_colors(arms)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm in arms:
        rows = result["by_staleness"][arm]
        s = np.array(sorted(rows), dtype=float)
        for ax, name, scale in ((axes[0], "change vs sampler", 100.0), (axes[1], "log-prob mismatch", 1.0)):
            mean = np.array([rows[int(x)][name]["mean"] for x in s]) * scale
            half = np.nan_to_num(np.array([rows[int(x)][name]["ci95"] for x in s]) * scale)
            band_plot(ax, s, mean, mean - half, mean + half, colors[arm], arm)
        predicted = np.array([rows[int(x)]["margin prediction"]["mean"] for x in s]) * 100.0
        axes[0].plot(s, predicted, color=colors[arm], linestyle=":", linewidth=1)
        steady = result["by_k"][arm]
        for ax, name, scale in ((axes[0], "change vs sampler", 100.0), (axes[1], "log-prob mismatch", 1.0)):
            ks = [k for k in steady if k > 0]
            ax.errorbar(ks, [steady[k][name]["mean"] * scale for k in ks],
                        yerr=[np.nan_to_num(steady[k][name]["ci95"]) * scale for k in ks],
                        color=colors[arm], marker="s", linestyle="none", capsize=3)
    axes[0].axhline(100 * PAPER_CHANGE, color="grey", linestyle="--", linewidth=1,
                    label="GSPO paper: ~10% after one update")
    axes[0].set(xlabel="staleness s (versions)", ylabel="expert change vs sampler (%)",
                title="sampler vs proximal routing (dotted: margin prediction)")
    axes[1].set(xlabel="staleness s (versions)", ylabel="mean |log π_sampler − log π_proximal|",
                title="log-prob mismatch the objective sees")
    path = finish(fig, axes, out_dir / "staleness.png", "Expert change against staleness")
    return {"staleness": (path, "Expert change between the stale sampler and the proximal policy, and the "
                                "log-prob mismatch, against the versions between them (mean ± 95% CI): lines, "
                                "the first steps of the largest-k runs; squares, each k's steady state.")}


SECTION = Section(
    name="staleness",
    heading="Expert change against staleness",
    intro=doc_intro(__doc__).split("\n\n")[0],
    file="staleness.md",
    applies=applies,
    compute=staleness_table,
    markdown=format_staleness,
    figures=plot_staleness,
    steps=True,
)
