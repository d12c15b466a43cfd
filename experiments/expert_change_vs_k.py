"""Expert change against staleness k, past the GSPO paper's single number (issue 57):
docs/results/stale_rivals/expert_change_vs_k.{png,json}.

    python experiments/expert_change_vs_k.py --calibration docs/results/stale_rivals/calibration_ws0 \
        --runs RUN_k16 RUN_k32 RUN_k64 --out docs/results/stale_rivals

Three readings on replay_staleness's setting (balanced 128 experts, routers at 30x the lr, GRPO, lr 1e-4):
- the calibration's staleness trajectory (`moe-rl-calibrate --staleness ...`, warm start 0): change on
  fixed rows from the routing at the start to the policy's k RL steps later, and the damage replay removes;
- stale training runs at k = 16, 32, 64 (one each, warm start 0, seed 0, 200 steps):
  `routing/expert_change/vs_sampler`, mean over steps >= k (the steady state);
- replay_staleness's GRPO runs at k = 2 and 8 (4 warm starts x 2 seeds, its table.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from analysis.compare import read_run

TABLE = Path(__file__).resolve().parents[1] / "docs" / "results" / "replay_staleness" / "table.json"


def run_change(run: Path) -> tuple[int, float, int]:
    """(k, mean vs_sampler change over steps >= k, steps) of one stale run folder."""
    summary, rows = read_run(run)
    k = int(summary["config"]["rollout"]["staleness"])
    values = [r["routing/expert_change/vs_sampler"] for r in rows if r["step"] >= k and "routing/expert_change/vs_sampler" in r]
    return k, statistics.fmean(values), len(values)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--runs", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cal = json.loads((args.calibration / "calibration.json").read_text())
    trajectory = sorted((r["scale"], r["expert_change"], r["dlogp_mean"], r["whole_dlogp_mean"])
                        for r in cal["rows"] if r["kind"] == "stale")
    one_update = next(r["expert_change"] for r in cal["rows"] if r["kind"] == "natural" and r["scale"] == cal["config"]["lr"])
    runs = sorted(run_change(r) for r in args.runs)
    by_k = json.loads(TABLE.read_text())["staleness"]["by_k"]["grpo (replay=off)"]
    earlier = sorted((int(k), v["change vs sampler"]["mean"], v["change vs sampler"]["ci95"]) for k, v in by_k.items())
    data = {
        "one_optimizer_update": one_update,
        "calibration_trajectory": [{"k": k, "expert_change": c, "replay_removable_dlogp": d, "whole_dlogp": w}
                                   for k, c, d, w in trajectory],
        "stale_runs": [{"k": k, "vs_sampler_mean": c, "steps": n} for k, c, n in runs],
        "replay_staleness_grpo": [{"k": k, "vs_sampler_mean": c, "ci95": h} for k, c, h in earlier],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "expert_change_vs_k.json").write_text(json.dumps(data, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([k for k, *_ in trajectory], [100 * c for _, c, *_ in trajectory], "o-",
            label="calibration trajectory: fixed rows, routing at the start vs k RL steps later (warm start 0)")
    ax.plot([k for k, *_ in runs], [100 * c for _, c, _ in runs], "s", ms=8,
            label="stale runs, vs_sampler over steps ≥ k (warm start 0, one run per k)")
    ax.errorbar([k for k, *_ in earlier], [100 * c for _, c, _ in earlier], yerr=[100 * h for *_, h in earlier],
                fmt="D", capsize=3, label="replay_staleness GRPO, vs_sampler (4 warm starts, 95% CI)")
    ax.axhline(100 * one_update, color="k", ls="--", lw=1, label=f"one optimizer update here ({100 * one_update:.1f}%)")
    ax.axhline(10, color="grey", ls=":", label="GSPO paper: ~10% after one update (Qwen3-30B-A3B)")
    ax.set(xscale="log", xlabel="staleness k (RL steps of 4 updates each)", ylabel="expert change (%)",
           title="Expert change between the sampler and the proximal policy")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out / "expert_change_vs_k.png", dpi=110)
    plt.close(fig)
    print(json.dumps(data, indent=1))
    return data


if __name__ == "__main__":
    main()
