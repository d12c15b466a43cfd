"""Power of stale_rivals' two candidate primary outcomes, simulated from replay_staleness's records, before
any run of stale_rivals (issue 57; docs/preregistration/stale_rivals.md).

    python experiments/stale_rivals_power.py                # prints the table the pre-registration quotes
    python experiments/stale_rivals_power.py --sims 4000 --out docs/preregistration/stale_rivals_power.md

What replay_staleness kept (docs/results/replay_staleness/table.json; its raw records were never committed):
every run's expected-accuracy AUC and sustained-regression flag, by warm start (4) and RL seed (2), for
GRPO, R2, R3, TIS and R3 + TIS at k = 0, 2, 8. From them:

- **AUC difference in differences** D = [arm(k=8) − arm(k=0)] − [GRPO(k=8) − GRPO(k=0)], per (warm start,
  seed). A one-way random-effects fit (method of moments) over the three k = 8 pairs observed (R2 − GRPO,
  TIS − GRPO, R3 − R2) gives σ_b (between warm starts) and σ_w (between seeds of one warm start). A study
  draws D_ws = δ + b_w + e_ws and tests the mean of its warm starts' seed means with a t over warm starts.
- **Ends regressed** per run: Bernoulli with log-odds logit(p_arm) + u_w, u_w ~ N(0, 0.5²) shared by a warm
  start's runs, tested by the exact conditional test stratified by warm start (analysis.stats). The table
  kept sustained regressions, not ends-regressed flags, so the rates are scenarios: the sustained rates
  observed at k = 8, and two thirds of them (confirm_sort_long: 6 of GRPO's 9 sustained regressions ended
  regressed).

α: 0.025 two-sided, the smaller p's level under Holm over the primary family of two (a lower bound on the
power Holm gives). Effects: what replay_staleness observed at k = 8 (R2 − GRPO: D = +0.039, sustained 5/8
vs 5/8) and what a correction that works observed (TIS − GRPO: D = +0.085, 1/8 vs 5/8).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from scipy import stats as sps

from analysis import clusters
from analysis.stats import exact_stratified

TABLE = Path(__file__).resolve().parents[1] / "docs" / "results" / "replay_staleness" / "table.json"
ARMS = {"grpo": "grpo (replay=off)", "r2": "grpo_rr (replay=old)", "r3": "grpo_r3 (replay=rollout)",
        "tis": "grpo_tis (replay=off)"}
PAIRS = (("r2", "grpo"), ("tis", "grpo"), ("r3", "r2"))
ALPHA = 0.025
HETEROGENEITY = 0.5
"""SD of the warm-start effect on the log-odds of ending regressed (an assumption: 4 warm starts cannot
estimate it)."""


def per_run(table: dict, key: str) -> dict[tuple[str, int], dict[tuple[int, int], float]]:
    """{(arm, k): {(warm start, seed): value}} of per-seed `key` ("auc") from the pairs' per-seed tables."""
    out = {}
    for pair in table["pairs"]:
        for side in "ab":
            label, ps = pair[side], pair["per_seed"][side]
            arm, k = label.rsplit(" staleness=", 1)
            out[(arm, int(k))] = {(w, s): v for w, s, v in zip(ps["warm_start"], ps["seed"], ps[key], strict=True)}
    return out


def sustained(table: dict, arm: str, k: int) -> tuple[int, int]:
    row = table["outcomes"][f"{arm} staleness={k}"]
    return row["regressed"], row["with_initial_eval"]


def variance_components(auc: dict) -> tuple[float, float, list[float]]:
    """(σ_b, σ_w, observed mean D per pair) pooled over PAIRS at k = 8 (method of moments)."""
    between, within, means = [], [], []
    for a, b in PAIRS:
        A, B = ARMS[a], ARMS[b]
        d = {u: (auc[A, 8][u] - auc[A, 0][u]) - (auc[B, 8][u] - auc[B, 0][u]) for u in auc[A, 0]}
        ws = sorted({w for w, _ in d})
        seeds = sorted({s for _, s in d})
        cells = np.array([[d[w, s] for s in seeds] for w in ws])
        b, w, _ = clusters.variance_components(cells)  # balanced: σ²_b = var(warm-start means) − σ²_w / seeds
        between.append(b)
        within.append(w)
        means.append(float(cells.mean()))
    return math.sqrt(np.mean(between)), math.sqrt(np.mean(within)), means


def power_did(delta: float, sb: float, sw: float, warm: int, seeds: int, sims: int, rng) -> float:
    b = rng.normal(0, sb, (sims, warm))
    e = rng.normal(0, sw, (sims, warm, seeds)).mean(-1)
    x = delta + b + e
    t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(warm))
    return float((2 * sps.t.sf(np.abs(t), warm - 1) < ALPHA).mean())


def power_ends(pa: float, pb: float, warm: int, seeds: int, sims: int, rng) -> float:
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    hits = 0
    for _ in range(sims):
        u = rng.normal(0, HETEROGENEITY, warm)
        ea = rng.random((warm, seeds)) < 1 / (1 + np.exp(-(logit(pa) + u[:, None])))
        eb = rng.random((warm, seeds)) < 1 / (1 + np.exp(-(logit(pb) + u[:, None])))
        res = exact_stratified(ea.sum(1).tolist(), [seeds] * warm, eb.sum(1).tolist(), [seeds] * warm)
        hits += res.p < ALPHA
    return hits / sims


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sims", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    table = json.loads(TABLE.read_text())
    auc = per_run(table, "auc")
    sb, sw, means = variance_components(auc)
    rates = {name: sustained(table, ARMS[name], 8) for name in ("grpo", "r2", "tis")}
    p = {name: max(0.02, min(0.98, x / n)) for name, (x, n) in rates.items()}
    rng = np.random.default_rng(57)
    lines = [
        "# stale_rivals: simulated power of the two candidate primary outcomes",
        "",
        f"From replay_staleness (`{TABLE.relative_to(TABLE.parents[3])}`), k = 8 against k = 0: σ_b = {sb:.4f} "
        f"(between warm starts), σ_w = {sw:.4f} (between seeds of a warm start) of the AUC difference in "
        f"differences, pooled over {', '.join(f'{a} − {b}' for a, b in PAIRS)} (observed D: "
        f"{', '.join(f'{m:+.3f}' for m in means)}). Sustained regressions at k = 8: "
        f"{', '.join(f'{n} {x}/{t}' for n, (x, t) in rates.items())}. α = {ALPHA} two-sided, {args.sims} "
        f"simulated studies per cell, seed 57.",
        "",
        "| warm starts x seeds | scenario | AUC D, t over warm starts | ends regressed, exact stratified |",
        "|---|---|---|---|",
    ]
    scenarios = [
        ("R2 − GRPO as observed (D = {d:+.3f}; ends at the sustained rates {a:.2f} vs {b:.2f})", means[0], p["grpo"], p["r2"]),
        ("R2 − GRPO, ends at 2/3 of the sustained rates", means[0], p["grpo"] * 2 / 3, p["r2"] * 2 / 3),
        ("a working correction, TIS − GRPO as observed (D = {d:+.3f}; {a:.2f} vs {b:.2f})", means[1], p["grpo"], p["tis"]),
        ("TIS − GRPO, ends at 2/3 of the sustained rates", means[1], p["grpo"] * 2 / 3, p["tis"] * 2 / 3),
    ]
    for warm in (8, 12, 16, 20, 24):
        for text, d, a, b in scenarios:
            pd = power_did(d, sb, sw, warm, 3, args.sims, rng)
            pe = power_ends(a, b, warm, 3, args.sims, rng)
            lines.append(f"| {warm} x 3 | {text.format(d=d, a=a, b=b)} | {pd:.2f} | {pe:.2f} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
