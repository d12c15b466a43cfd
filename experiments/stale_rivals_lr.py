"""stale_rivals' step-size rule, as pre-registered (docs/preregistration/stale_rivals.md): each of GSPO,
VESPO and DPPO takes the grid lr whose per-update KL is nearest GRPO's at 1e-4 on a log scale.

    python experiments/stale_rivals_lr.py SWEEP_DIR --out docs/results/stale_rivals/step_size.json

Per-update KL of a cell (objective preset, lr): the mean of `policy/approx_kl` over steps 10-39 of each of
its runs, then over its runs (the calibration warm starts 100, 101 x seeds 0, 1). Ties: the smaller lr. An
arm whose choice is a grid edge is flagged: the grid does not bracket it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import warnings
from collections import defaultdict
from pathlib import Path

from analysis.load import Run, load_local

TARGET = ("grpo", 1e-4)
ARMS = ("gspo", "vespo_stale", "dppo_tv_sampler")
STEPS = range(10, 40)


def run_kl(run: Run) -> float:
    """Mean `policy/approx_kl` over the run's steps 10-39 (nan when it has none there)."""
    values = [row["policy/approx_kl"] for row in run.rows if row["step"] in STEPS and "policy/approx_kl" in row]
    values = [v for v in values if math.isfinite(v)]
    return statistics.fmean(values) if values else math.nan


def cell_kls(runs: list[Run]) -> dict[tuple[str, float], float]:
    """{(preset, lr): mean over its runs of run_kl}."""
    cells = defaultdict(list)
    for run in runs:
        cells[(run.config["objective"]["preset"], float(run.config["trainer"]["lr"]))].append(run_kl(run))
    return {cell: statistics.fmean(v) for cell, v in cells.items() if all(math.isfinite(x) for x in v)}


def choose(kls: dict[tuple[str, float], float]) -> dict[str, dict]:
    """Each arm's lr by the rule, with its KL, the target's, and whether it lies on the grid's edge."""
    if TARGET not in kls:
        raise ValueError(f"no KL for the target cell {TARGET}")
    target = kls[TARGET]
    out = {}
    for arm in ARMS:
        grid = sorted(lr for preset, lr in kls if preset == arm)
        if not grid:
            raise ValueError(f"no runs of {arm}")
        # ties (to 1e-9 in log KL, so that float rounding decides none): the smaller lr
        lr = min(grid, key=lambda x: (round(abs(math.log(kls[arm, x]) - math.log(target)), 9), x))
        out[arm] = {"lr": lr, "kl": kls[arm, lr], "target_kl": target, "grid": grid,
                    "edge": lr in (grid[0], grid[-1]), "kl_by_lr": {str(x): kls[arm, x] for x in grid}}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = load_local([args.sweep], progress=False)
    chosen = choose(cell_kls(runs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rule": __doc__.split("\n\n")[0], "runs": len(runs), "arms": chosen}, indent=1))
    for arm, row in chosen.items():
        print(f"{arm}: lr {row['lr']:g} (KL {row['kl']:.3g} vs GRPO's {row['target_kl']:.3g})"
              + (" at the grid's edge" if row["edge"] else ""))
    return chosen


if __name__ == "__main__":
    main()
