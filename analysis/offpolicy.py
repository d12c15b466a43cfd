"""R2 vs R3 vs off-policiness: the three findings of Qwen's "Stabilizing Reinforcement Learning with LLMs:
Formulation and Practices" (arXiv 2512.01374), judged on a sweep that crosses a training-inference mismatch
source with the mini-batches per rollout (experiments/reproduce.sh replay_offpolicy).

Each run has a mismatch source, read from its config (`source`): "none" (the sampler is the trained model:
`trainer.sampler_dtype` null, no trainer-side noise), "bf16 sampler" (`trainer.sampler_dtype=bfloat16`)
or "trainer noise σ=…" (`routing.logit_noise` σ with `routing.noise_scope=trainer`: sampler/trainer routing
mismatch as a control); an off-policiness M = `trainer.mini_batches` (mini-batch j is j - 1 updates stale);
and an arm (ARMS, from the objective preset and replay source): off (GRPO), R2 (`routing.replay=old`), R3
(`routing.replay=rollout`), TIS (GRPO + token-level truncated importance sampling against the sampler).

Per (source, M) cell and arm: the expected-accuracy AUC (analysis.outcomes.auc; mean ± 95% t-CI over
seeds), the mean over steps of the log-prob mismatch the objective sees (`mismatch/logp_abs_diff/mean`),
the seeds with a collapse event, and the cost: wall seconds per run, Σ `time/step_s` + Σ `time/eval_s`
(start-up and warm-start loading left out). The contrasts, each the AUC difference paired by seed (paired
t; a seed's warm start and eval set are shared by every arm), judge the findings:

| finding | contrast | read at |
|---|---|---|
| 1. on-policy, policy gradient with IS correction is the most stable | TIS - off, TIS - R2, TIS - R3 | M = 1 |
| 2. off-policy, routing replay becomes essential | R2 - off | each M, and its trend over M |
| 3. R2 suffices at small off-policiness, R3 is needed at larger | R3 - R2 | each M, and its trend over M |

The trend of a contrast: within each seed, the least-squares slope of the contrast on log2 M, then a
one-sample t-test over the seeds' slopes (analysis.stats.slope_over_seeds): the change per doubling of
the mini-batches. A finding that names a growing need reads as a positive trend. The paper studies
clipping too; the arms here all clip (GRPO's ε = 0.2), and the safety_nets ablation takes clipping away.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from analysis.clusters import CLUSTERED, detect_design, unit_key
from analysis.drift import plain
from analysis.load import Run
from analysis.outcomes import auc, has_expected
from analysis.pairs import collapsed, outcome_difference
from analysis.plotting import finish, plt
from analysis.sections import Section, doc_intro
from analysis.stats import finite_mean, format_difference, mean_ci, short_verdict, slope_over_seeds, verdict

ARMS = {"grpo (replay=off)": "off", "grpo_rr (replay=old)": "R2", "grpo_r3 (replay=rollout)": "R3",
        "grpo_tis (replay=off)": "TIS"}  # fmt: skip
"""Base label -> arm."""
CONTRASTS = (("TIS", "off"), ("TIS", "R2"), ("TIS", "R3"), ("R3", "off"), ("R2", "off"), ("R3", "R2"))
TRENDS = (("R2", "off"), ("R3", "R2"), ("R3", "off"))
"""Contrasts whose trend over log2 M is tested (findings 2 and 3)."""
CAPTION = (
    "The paired expected-accuracy AUC difference of each replay contrast (mean over seeds, 95% CI) against the "
    "mini-batches per rollout (off-policiness), one panel per training-inference mismatch source; zero dotted."
)


def source(run: Run) -> str:
    """The run's training-inference mismatch source (see the module docstring)."""
    flat = run.flat
    sigma = float(flat.get("routing.logit_noise") or 0.0)
    if sigma > 0 and flat.get("routing.noise_scope") == "trainer":
        return f"trainer noise σ={sigma:g}"
    if flat.get("trainer.sampler_dtype") not in (None, "null", "float32"):
        return f"{str(flat['trainer.sampler_dtype']).replace('bfloat16', 'bf16')} sampler"
    return "none"


def _cells(runs: list[Run]) -> dict[tuple[str, int], dict[str, list[Run]]]:
    cells: dict[tuple[str, int], dict[str, list[Run]]] = {}
    for run in runs:
        arm = ARMS.get(run.base_label)
        if arm is not None:
            key = (source(run), int(run.flat["trainer.mini_batches"]))
            cells.setdefault(key, {}).setdefault(arm, []).append(run)
    return {k: {a: sorted(v, key=lambda r: r.seed) for a, v in sorted(arms.items(), key=lambda kv: list(ARMS.values()).index(kv[0]))}
            for k, arms in sorted(cells.items())}  # fmt: skip


def applies(runs: list[Run]) -> bool:
    """Whether the runs form such a sweep: expected-accuracy evals, replay off and R2 both present, and more
    than one value of trainer.mini_batches."""
    arms = {ARMS.get(r.base_label) for r in runs}
    return has_expected(runs) and {"off", "R2"} <= arms and len({r.flat.get("trainer.mini_batches") for r in runs}) > 1


def cost_s(run: Run) -> float:
    """Wall seconds of the run's steps and evaluations."""
    return run.total("time/step_s") + run.total("time/eval_s")


def offpolicy_table(runs: list[Run]) -> list[dict[str, Any]]:
    """One dict per (source, M) cell: per arm the AUC, mismatch and cost (MeanCI), collapsed seeds and every
    seed's values; per contrast whose arms both ran, the paired AUC Difference and its verdict."""
    out = []
    for (src, m), arms in _cells(runs).items():
        row: dict[str, Any] = {"source": src, "mini_batches": m, "arms": {}, "contrasts": {}}
        for arm, rs in arms.items():
            per_seed = {"seed": [r.seed for r in rs], "auc": [auc(r) for r in rs],
                        "mismatch": [r.mean("mismatch/logp_abs_diff/mean") for r in rs],
                        "cost_s": [cost_s(r) for r in rs], "collapsed": [collapsed(r) for r in rs]}  # fmt: skip
            row["arms"][arm] = {"auc": mean_ci(per_seed["auc"]), "mismatch": mean_ci(per_seed["mismatch"]),
                                "cost_s": mean_ci(per_seed["cost_s"]), "collapsed": sum(per_seed["collapsed"]),
                                "per_seed": per_seed}  # fmt: skip
        for a, b in CONTRASTS:
            if a in arms and b in arms:
                d = outcome_difference(arms[a], arms[b], auc)
                row["contrasts"][f"{a} - {b}"] = {"diff": d, "verdict": verdict(d)}
        out.append(row)
    return out


def offpolicy_trends(runs: list[Run]) -> dict[str, dict[str, Any]]:
    """Per source and TRENDS contrast: the mean per-seed slope of the paired AUC contrast on log2 M (per
    doubling), its one-sample t-test over seeds, and each seed's slope: {source: {"R2 - off": {...}}}."""
    out: dict[str, dict[str, Any]] = {}
    cells = _cells(runs)
    clustered = detect_design(runs).kind == CLUSTERED  # then a unit is (warm start, seed): analysis.clusters
    for src in dict.fromkeys(s for s, _ in cells):
        for a, b in TRENDS:
            x: dict[int, list[float]] = {}
            y: dict[int, list[float]] = {}
            for (s, m), arms in cells.items():
                if s != src or a not in arms or b not in arms:
                    continue
                other = {unit_key(r, clustered): auc(r) for r in arms[b]}
                for r in arms[a]:
                    k = unit_key(r, clustered)
                    if k in other:
                        x.setdefault(k, []).append(math.log2(m))
                        y.setdefault(k, []).append(auc(r) - other[k])
            if len({v for xs in x.values() for v in xs}) > 1:
                slope, per_seed = slope_over_seeds(x, y)
                out.setdefault(src, {})[f"{a} - {b}"] = {"slope": slope, "verdict": verdict(slope), "per_seed": per_seed}
    return out


def format_offpolicy(table: list[dict[str, Any]], trends: dict[str, dict[str, Any]]) -> str:
    """Markdown: the per-cell arm table, the contrast table and the trend table."""
    arm_names = list(dict.fromkeys(a for row in table for a in row["arms"]))
    lines = ["| source | mini-batches | " + " | ".join(f"AUC {a}" for a in arm_names)
             + " | log-prob mismatch (off) | seeds collapsed | s per run |",
             "|---" * (len(arm_names) + 5) + "|"]  # fmt: skip
    for row in table:
        arms = row["arms"]
        cells = [f"{arms[a]['auc'].mean:.3f} ± {arms[a]['auc'].half:.3f}" if a in arms else "" for a in arm_names]
        first = arms.get("off") or next(iter(arms.values()))
        coll = ", ".join(f"{a} {v['collapsed']}/{len(v['per_seed']['seed'])}" for a, v in arms.items())
        cost = finite_mean(np.array([v["cost_s"].mean for v in arms.values()]))
        lines.append(f"| {row['source']} | {row['mini_batches']} | " + " | ".join(cells)
                     + f" | {first['mismatch'].mean:.2g} | {coll} | {cost:.0f} |")  # fmt: skip
    lines += ["", "| source | mini-batches | contrast | seeds | AUC difference (95% CI), p | verdict |", "|---" * 6 + "|"]
    for row in table:
        for name, c in row["contrasts"].items():
            lines.append(f"| {row['source']} | {row['mini_batches']} | {name} | {c['diff'].n_a} | {format_difference(c['diff'])} "
                         f"| {short_verdict(c['verdict'])} |")  # fmt: skip
    lines += ["", "| source | contrast | seeds | change per doubling of mini-batches (95% CI), p | verdict |",
              "|---" * 5 + "|"]  # fmt: skip
    for src, by in trends.items():
        for name, t in by.items():
            lines.append(f"| {src} | {name} | {t['slope'].n_a} | {format_difference(t['slope'])} | {short_verdict(t['verdict'])} |")
    return "\n".join(lines)


def offpolicy_json(table: list[dict[str, Any]], trends: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Both tables as plain JSON values, every seed's value kept."""
    return {"cells": [plain(row) for row in table], "trends": plain(trends)}


def plot_offpolicy(table: list[dict[str, Any]], out_dir: Path) -> Path:
    """offpolicy.png: one panel per source, each contrast's paired AUC difference against M (log2 axis)."""
    sources = list(dict.fromkeys(row["source"] for row in table))
    fig, axes = plt.subplots(1, len(sources), figsize=(4.5 * len(sources), 3.6), squeeze=False, sharey=True)
    names = [f"{a} - {b}" for a, b in CONTRASTS]
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, src in zip(axes[0], sources, strict=True):
        rows = [row for row in table if row["source"] == src]
        for i, name in enumerate(names):
            pts = [(row["mini_batches"], row["contrasts"][name]["diff"]) for row in rows if name in row["contrasts"]]
            if not pts:
                continue
            m = np.array([p[0] for p in pts], dtype=float) * 2 ** (0.04 * (i - len(names) / 2))  # dodge
            d = np.array([[p[1].diff, p[1].diff - p[1].lo, p[1].hi - p[1].diff] for p in pts])
            ax.errorbar(m, d[:, 0], yerr=np.nan_to_num(d[:, 1:].T), marker="o", ms=4, capsize=2, label=name, color=colors[name])
        ax.axhline(0, color="k", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_title(src)
        ax.set_xlabel("mini-batches per rollout")
    axes[0][0].set_ylabel("paired Δ expected-acc AUC")
    return finish(fig, list(axes[0]), out_dir / "offpolicy.png", "Replay contrasts against off-policiness")


SECTION = Section(
    name="offpolicy",
    heading="Replay against off-policiness",
    intro=doc_intro(__doc__),
    file="offpolicy.md",
    applies=lambda sweep: applies(sweep.runs),
    compute=lambda sweep: (offpolicy_table(sweep.runs), offpolicy_trends(sweep.runs)),
    markdown=lambda r: format_offpolicy(*r),
    json=lambda r: {"offpolicy": offpolicy_json(*r)},
    figures=lambda r, out_dir: {"offpolicy": (plot_offpolicy(r[0], out_dir), CAPTION)},
    lead=True,
)
