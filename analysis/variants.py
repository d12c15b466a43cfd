"""Replay variants against the base of their arm: do float32 routers or replayed gates move the mismatch?

A sweep that varies `model.router_dtype` or `routing.replay_gates` (experiments/reproduce.sh replay_variants)
gives each run a variant, read from its config (VARIANTS): "fp32 routers" (`model.router_dtype=float32`),
"replayed gates" (`routing.replay_gates=true`), both, or "base"; and an arm, its objective preset and replay
source. Per run, the mean over steps of:

| outcome | metric |
|---|---|
| mismatch (primary) | `mismatch/logp_abs_diff/mean`: mean \\|log π_sampler − log π_old\\| over response tokens, as the objective sees it |
| routing vs old | `routing/rollout_vs_old/frac`: the sampler's experts the old-policy forward did not choose (its free choice under replay) |

Each variant's runs are compared with the base runs of the same arm and seed: the difference variant − base,
paired by seed (paired t; a seed's warm start, prompts and eval set are shared), also as a percentage of the
base's mean. Holm's adjusted p (analysis.stats.holm) runs over the primary contrasts, one per (arm, variant).
"""

from __future__ import annotations

import math
from typing import Any

from analysis.load import Run
from analysis.sections import Section, Sweep, doc_intro
from analysis.stats import holm, mean_ci, paired_t, verdict

FIELDS = ("model.router_dtype", "routing.replay_gates")
OUTCOMES = {"mismatch": "mismatch/logp_abs_diff/mean", "routing vs old": "routing/rollout_vs_old/frac"}
PRIMARY = "mismatch"


def variant(run: Run) -> str:
    """The run's variant: "base", "fp32 routers", "replayed gates" or both, joined by " + "."""
    flat = run.flat
    parts = [name for name, on in (("fp32 routers", flat.get("model.router_dtype") == "float32"),
                                   ("replayed gates", bool(flat.get("routing.replay_gates")))) if on]
    return " + ".join(parts) or "base"


def applies(sweep: Sweep) -> bool:
    return any(f in sweep.fields for f in FIELDS)


def variant_contrasts(sweep: Sweep) -> dict[str, Any] | None:
    """Per arm and variant: each outcome's mean ± CI and its paired difference to the arm's base (module docstring)."""
    cells: dict[str, dict[str, dict[int, Run]]] = {}
    for run in sweep.runs:
        cells.setdefault(run.base_label, {}).setdefault(variant(run), {})[run.seed] = run
    rows = []
    for arm, by_variant in cells.items():
        base = by_variant.get("base")
        if base is None:
            continue
        for name, runs in by_variant.items():
            if name == "base":
                continue
            seeds = sorted(runs.keys() & base.keys())
            row: dict[str, Any] = {"arm": arm, "variant": name, "seeds": seeds}
            for outcome, key in OUTCOMES.items():
                a = [runs[s].mean(key) for s in seeds]
                b = [base[s].mean(key) for s in seeds]
                d = paired_t(a, b)
                ref = mean_ci(b).mean
                row[outcome] = {"variant": mean_ci(a).mean, "base": ref, "diff": d.diff, "lo": d.lo, "hi": d.hi,
                                "p": d.p, "pct": 100 * d.diff / ref if ref else math.nan,
                                "per_seed": {"variant": a, "base": b}, "verdict": verdict(d)}
            rows.append(row)
    if not rows:
        return None
    for row, adjusted in zip(rows, holm([r[PRIMARY]["p"] for r in rows]), strict=True):
        row[PRIMARY]["holm"] = adjusted
    return {"rows": rows}


def _g(x: float, fmt: str = ".3g") -> str:
    return f"{x:{fmt}}" if math.isfinite(x) else "n/a"


def format_variants(result: dict[str, Any]) -> str:
    lines = ["| arm | variant | outcome | base | variant | difference [95% CI] | % of base | p | Holm p | seeds |",
             "|---" * 10 + "|"]
    words = []
    for r in result["rows"]:
        for outcome in OUTCOMES:
            o = r[outcome]
            holm_p = _g(o["holm"], ".2g") if "holm" in o else "–"
            lines.append(f"| {r['arm']} | {r['variant']} | {outcome} | {_g(o['base'], '.4g')} | {_g(o['variant'], '.4g')} "
                         f"| {_g(o['diff'], '+.3g')} [{_g(o['lo'])}, {_g(o['hi'])}] | {_g(o['pct'], '+.1f')}% "
                         f"| {_g(o['p'], '.2g')} | {holm_p} | {len(r['seeds'])} |")
        words.append(f"- {r['arm']}, {r['variant']} − base, mismatch: {_g(r[PRIMARY]['pct'], '+.1f')}%: "
                     f"{r[PRIMARY]['verdict']}.")
    return "\n\n".join(["\n".join(lines), "\n".join(words)])


SECTION = Section(
    name="variants",
    heading="Replay variants against their arm's base",
    intro=doc_intro(__doc__).split("\n\n")[0],
    file="variants.md",
    applies=applies,
    compute=variant_contrasts,
    markdown=format_variants,
)
