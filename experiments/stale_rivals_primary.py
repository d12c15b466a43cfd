"""stale_rivals' primary family, as pre-registered (docs/preregistration/stale_rivals.md), written before any
outcome was read.

    python experiments/stale_rivals_primary.py multirun/stale_rivals --out docs/results/stale_rivals/primary
    python experiments/stale_rivals_primary.py docs/results/stale_rivals/runs.parquet --out ...   # a per-run table

Per run y = the expected-accuracy AUC over its 200 steps (analysis.outcomes.auc); per unit u = (warm start,
RL seed) and arm X, the staleness effect e_X,u = y_X,u(k=8) − y_X,u(k=0). The two contrasts:

| | contrast per unit | arms |
|---|---|---|
| (a) does replay help | D_a,u = e_R2,u − e_GRPO,u | `grpo_rr` and `grpo` at lr 1e-4 |
| (b) is GSPO better than replay | D_b,u = e_GSPO,u − e_R2,u | `gspo` at its own lr (step_size.json) and `grpo_rr` at 1e-4 |

Each D is averaged over a warm start's seeds and tested by a two-sided Student t over the 20 warm starts
(analysis.clusters.cluster_contrast, with σ² between and within warm starts and the ICC); the two p-values
are Holm-adjusted within the family, α = 0.05, and the verdict in words reads the adjusted p.

Blind until complete: with fewer than the 360 primary runs (6 cells x 20 warm starts x 3 seeds) it prints
the count per cell and exits 1, reading no outcome. Once the driver has finished, `--failed-ok` names and
counts every missing run (a failed one) and leaves it out only of the contrasts that need it: a unit
missing one of an arm's two k enters neither that arm's effect nor the contrasts built on it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from analysis.clusters import cluster_contrast, warm_start_verdict
from analysis.load import Run, load_local
from analysis.outcomes import auc
from analysis.runtable import read_table
from analysis.stats import Difference, holm

ROOT = Path(__file__).resolve().parents[1]
STEP_SIZE = ROOT / "docs" / "results" / "stale_rivals" / "step_size.json"
WARM_STARTS, SEEDS, KS, STEPS, SHARED_LR = range(20), range(3), (0, 8), 200, 1e-4
ARMS = {"GRPO": "grpo", "R2": "grpo_rr", "GSPO": "gspo"}
"""The primary arms by the preset each runs."""
CONTRASTS = {"a": ("R2", "GRPO", "does replay help: GRPO + R2 against GRPO"),
             "b": ("GSPO", "R2", "is GSPO better than replay: GSPO at its own lr against GRPO + R2")}


def arm_lrs(step_size: dict) -> dict[str, float]:
    """Each primary arm's lr: 1e-4 for the GRPO arms, GSPO's from the step-size rule."""
    return {"GRPO": SHARED_LR, "R2": SHARED_LR, "GSPO": float(step_size["arms"]["gspo"]["lr"])}


def cell_of(run: Run, lrs: dict[str, float]) -> tuple[str, int, int, int] | None:
    """(arm, k, warm start, seed) of a primary run; None for any other run of the sweep (the step-size stage,
    the secondary cells, GSPO at the shared lr)."""
    flat = run.flat
    arm = next((a for a, preset in ARMS.items() if preset == flat.get("objective.preset")), None)
    k, w = flat.get("rollout.staleness"), flat.get("warmstart.build_seed")
    if (arm is None or k not in KS or w not in WARM_STARTS or run.seed not in SEEDS
            or flat.get("trainer.steps") != STEPS or not math.isclose(float(flat.get("trainer.lr")), lrs[arm])):
        return None
    return arm, int(k), int(w), run.seed


def primary_cells(runs: list[Run], lrs: dict[str, float]) -> dict[tuple[str, int, int, int], Run]:
    """The primary runs by (arm, k, warm start, seed); ValueError naming a cell that holds two runs."""
    cells: dict[tuple[str, int, int, int], Run] = {}
    for run in runs:
        if (cell := cell_of(run, lrs)) is not None:
            if cell in cells:
                raise ValueError(f"two runs of {cell}: {cells[cell].source} and {run.source}")
            cells[cell] = run
    return cells


def expected() -> list[tuple[str, int, int, int]]:
    return [(a, k, w, s) for a in ARMS for k in KS for w in WARM_STARTS for s in SEEDS]


def effects(cells: dict[tuple[str, int, int, int], Run], arm: str) -> dict[int, dict[int, float]]:
    """{warm start: {seed: y(k=8) − y(k=0)}} of one arm, over the units that hold both runs."""
    out: dict[int, dict[int, float]] = {}
    for w in WARM_STARTS:
        for s in SEEDS:
            if (arm, 0, w, s) in cells and (arm, 8, w, s) in cells:
                out.setdefault(w, {})[s] = auc(cells[arm, 8, w, s]) - auc(cells[arm, 0, w, s])
    return out


def primary(cells: dict[tuple[str, int, int, int], Run]) -> dict[str, Any]:
    """Both contrasts with their Holm-adjusted p-values, and the missing runs by name."""
    rows = {}
    for name, (a, b, question) in CONTRASTS.items():
        c = cluster_contrast(effects(cells, a), effects(cells, b))
        rows[name] = {"question": question, "diff": c.diff, "lo": c.lo, "hi": c.hi, "p": c.p,
                      "warm_starts": c.warm_starts, "units": c.runs, "var_between": c.var_between,
                      "var_within": c.var_within, "icc": c.icc, "per_warm_start": list(c.per_warm_start)}
    for row, p_holm in zip(rows.values(), holm([r["p"] for r in rows.values()]), strict=True):
        row["p_holm"] = p_holm
        d = Difference(row["diff"], row["lo"], row["hi"], p_holm, row["warm_starts"], row["warm_starts"],
                       "t over warm starts, Holm over the two")
        row["verdict"] = warm_start_verdict(d)
    missing = [cell for cell in expected() if cell not in cells]
    return {"contrasts": rows, "runs": len(cells), "expected": len(expected()),
            "missing": [f"{a} k={k} warm start {w} seed {s}" for a, k, w, s in missing]}


def counts(cells: dict[tuple[str, int, int, int], Run]) -> str:
    """Runs found per (arm, k), of 60 each: all a blind check may print."""
    per = {(a, k): sum(1 for c in cells if c[:2] == (a, k)) for a in ARMS for k in KS}
    return ", ".join(f"{a} k={k}: {n}/{len(WARM_STARTS) * len(SEEDS)}" for (a, k), n in per.items())


def markdown(result: dict[str, Any]) -> str:
    lines = ["| contrast | D (AUC) | 95% CI | p | p (Holm) | warm starts | units | σ² between | σ² within | ICC | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["contrasts"].items():
        lines.append(f"| ({name}) {r['question']} | {r['diff']:+.4f} | [{r['lo']:+.4f}, {r['hi']:+.4f}] | "
                     f"{r['p']:.3g} | {r['p_holm']:.3g} | {r['warm_starts']} | {r['units']} | "
                     f"{r['var_between']:.3g} | {r['var_within']:.3g} | {r['icc']:.3g} | {r['verdict']} |")
    missing = result["missing"]
    lines.append(f"\n{result['runs']} of {result['expected']} primary runs; "
                 + (f"missing (failed), left out of the contrasts that need them: {'; '.join(missing)}."
                    if missing else "none missing."))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the sweep folder, or a per-run table (runs.parquet)")
    parser.add_argument("--out", type=Path, required=True, help="folder for primary.md and primary.json")
    parser.add_argument("--step-size", type=Path, default=STEP_SIZE)
    parser.add_argument("--failed-ok", action="store_true",
                        help="the driver has finished: name the missing runs as failed and analyse without them")
    args = parser.parse_args(argv)
    runs = read_table(args.source) if args.source.suffix == ".parquet" else load_local([args.source], progress=False)
    cells = primary_cells(runs, arm_lrs(json.loads(args.step_size.read_text())))
    if len(cells) < len(expected()) and not args.failed_ok:
        print(f"stale_rivals_primary: blind, {len(cells)} of {len(expected())} primary runs ({counts(cells)}); "
              "no outcome read", file=sys.stderr)
        raise SystemExit(1)
    result = primary(cells)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "primary.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "primary.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
