"""Each objective at its own step size: three contrasts of two arms from a sweep over the learning rate.

An objective's best lr differs from another's (GSPO's clip band is narrower than one update's spread of
sequence ratios), so a contrast at one shared lr can carry the sign of a step-size effect. When a sweep
varies `trainer.lr` over at least MIN_LRS values, every two *arms* (a group less its lr) that agree on
every other varying field and ran the same seeds get three contrasts a - b of the per-run outcome y (the
expected-accuracy AUC when runs logged it, else as analysis.pairs: final eval accuracy, else final reward):

| contrast | how |
|---|---|
| at a shared lr | for each lr both arms ran: the paired t over seeds of y_a(lr, s) − y_b(lr, s) |
| each at its own best lr (cross-fitted) | the seeds, sorted, are split into two halves (alternate seeds). On one half each arm's best lr is the argmax over lrs of its mean y (ties: the smaller lr); on the other half every seed gives d_s = y_a(lr*_a, s) − y_b(lr*_b, s); then the halves swap. The paired t runs over all seeds' d_s. A seed's d_s is never measured at an lr its own value helped choose, so picking the maximum does not inflate the contrast; the interval does not carry the variance of the choice itself (which lr won on the other half), and the two halves may choose different lrs (both are shown) |
| the same, chosen in sample (biased, for reference) | best lr chosen on all seeds and evaluated on the same seeds: the winner's curse makes it optimistic for both arms |
| at matched per-update KL | per arm, the mean over seeds of its per-run mean `policy/approx_kl` at each lr; log10 KL is linearly interpolated against log10 lr to find the lr at which the arm reaches KL κ (nan when κ lies outside the KLs it reached, or its KL does not rise with lr: no extrapolation). Each seed's y is then linearly interpolated in log10 lr at that lr, and the paired t runs over seeds. κ: at each lr of the grid, the geometric mean of the two arms' KLs there, where it lies inside both arms' ranges |

Every interval is a 95% Student t interval over seeds (analysis.stats.paired_t) and carries the caveat of
the sweep's design (analysis.clusters): seeds of one warm start share it. With several warm starts each
carrying RL seeds (`compare_arms_clustered`), every contrast is instead the cluster contrast (units paired
within a warm start, a t over warm starts, with the ICC), and the cross-fitting folds split the warm
starts (alternate warm starts tune, the others are scored, then swapped). The lr mapping at matched KL
is treated as known (its seed noise is not propagated).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from analysis.clusters import CLUSTERED, cluster_contrast, detect_design, unit, unit_key, warm_start_verdict
from analysis.load import Run
from analysis.outcomes import auc, has_expected
from analysis.pairs import final_eval, final_reward
from analysis.sections import Section, doc_intro
from analysis.stats import LEVEL, Difference, paired_t, verdict

LR = "trainer.lr"
KL = "policy/approx_kl"
MIN_LRS = 3
"""A sweep with fewer lrs than this cannot say where an arm's best lies: no own-lr section."""

Grid = dict[float, dict[int, float]]
"""{lr: {seed: value}} of one arm."""


def _seeds(*grids: Grid) -> list[int]:
    """Seeds with a finite value at every lr of every grid, sorted."""
    sets = [{s for s, v in by_seed.items() if math.isfinite(v)} for g in grids for by_seed in g.values()]
    return sorted(set.intersection(*sets)) if sets else []


def _paired(a: Sequence[float], b: Sequence[float], level: float) -> Difference:
    return paired_t(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), level)


def shared_lr(a: Grid, b: Grid, level: float = LEVEL) -> dict[float, Difference]:
    """{lr: paired t of a - b over the seeds both arms ran at that lr} for every lr both arms ran."""
    out = {}
    for lr in sorted(set(a) & set(b)):
        seeds = sorted(set(a[lr]) & set(b[lr]))
        out[lr] = _paired([a[lr][s] for s in seeds], [b[lr][s] for s in seeds], level)
    return out


def best_lr(grid: Grid, seeds: Sequence[int]) -> float:
    """The lr whose mean value over `seeds` is highest (the smaller lr on a tie)."""
    means = {lr: float(np.mean([grid[lr][s] for s in seeds])) for lr in sorted(grid)}
    return max(means, key=lambda lr: (means[lr], -lr))


def halves(seeds: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The two cross-fitting folds (tune, evaluate) of the sorted seeds: alternate seeds, then swapped."""
    s = sorted(seeds)
    first, second = s[0::2], s[1::2]
    return [(first, second), (second, first)]


def own_lr(a: Grid, b: Grid, folds: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
           level: float = LEVEL) -> tuple[Difference, list[dict[str, Any]]]:  # fmt: skip
    """Each arm at its own best lr, chosen on each fold's tuning seeds and evaluated on its disjoint
    evaluation seeds; paired t over every evaluated seed's difference. Default folds: `halves` of the
    seeds both arms ran at every lr. Returns (Difference, [{"tune", "evaluate", "lr_a", "lr_b"}] per fold)."""
    folds = halves(_seeds(a, b)) if folds is None else folds
    da, db, chosen = [], [], []
    for tune, evaluate in folds:
        if set(tune) & set(evaluate):
            raise ValueError(f"tuning seeds {sorted(tune)} and evaluation seeds {sorted(evaluate)} overlap")
        if not tune or not evaluate:
            continue
        la, lb = best_lr(a, tune), best_lr(b, tune)
        chosen.append({"tune": sorted(tune), "evaluate": sorted(evaluate), "lr_a": la, "lr_b": lb})
        da += [a[la][s] for s in evaluate]
        db += [b[lb][s] for s in evaluate]
    return _paired(da, db, level), chosen


def in_sample_best(a: Grid, b: Grid, level: float = LEVEL) -> tuple[Difference, float, float]:
    """Best lr chosen and evaluated on the same seeds (biased upward for both arms): (Difference, lr_a, lr_b)."""
    seeds = _seeds(a, b)
    if not seeds:
        return _paired([], [], level), math.nan, math.nan
    la, lb = best_lr(a, seeds), best_lr(b, seeds)
    return _paired([a[la][s] for s in seeds], [b[lb][s] for s in seeds], level), la, lb


def lr_at_kl(kl: Grid, kappa: float, seeds: Sequence[int]) -> float:
    """The lr at which the arm's mean KL over `seeds` reaches kappa: log10 KL linear in log10 lr between
    grid points; nan outside the reached range or when the mean KL does not rise strictly with lr."""
    lrs = sorted(kl)
    x = np.log10(lrs)
    y = np.log10([float(np.mean([kl[lr][s] for s in seeds])) for lr in lrs])
    if not np.all(np.diff(y) > 0) or not y[0] <= math.log10(kappa) <= y[-1]:
        return math.nan
    return float(10 ** np.interp(math.log10(kappa), y, x))


def value_at_lr(grid: Grid, lr: float, seed: int) -> float:
    """One seed's value linearly interpolated in log10 lr."""
    lrs = sorted(grid)
    return float(np.interp(math.log10(lr), np.log10(lrs), [grid[g][seed] for g in lrs]))


def matched_kl(a: Grid, a_kl: Grid, b: Grid, b_kl: Grid, level: float = LEVEL) -> list[dict[str, Any]]:
    """The contrast at matched per-update KL, one row per κ (module docstring):
    [{"kl", "lr_a", "lr_b", "difference": Difference}]."""
    seeds = _seeds(a, b, a_kl, b_kl)
    rows: list[dict[str, Any]] = []
    if len(seeds) < 2:
        return rows
    for lr in sorted(set(a_kl) & set(b_kl)):
        kappa = math.sqrt(np.mean([a_kl[lr][s] for s in seeds]) * np.mean([b_kl[lr][s] for s in seeds]))
        la, lb = lr_at_kl(a_kl, kappa, seeds), lr_at_kl(b_kl, kappa, seeds)
        if not (math.isfinite(la) and math.isfinite(lb)):
            continue
        d = _paired([value_at_lr(a, la, s) for s in seeds], [value_at_lr(b, lb, s) for s in seeds], level)
        rows.append({"kl": kappa, "at_lr": lr, "lr_a": la, "lr_b": lb, "difference": d})
    return rows


def compare_arms(a: Grid, b: Grid, a_kl: Grid | None, b_kl: Grid | None) -> dict[str, Any]:
    """The three contrasts (and the in-sample reference) of arm a - arm b, as a table.json-ready dict."""
    own, folds = own_lr(a, b)
    naive, la, lb = in_sample_best(a, b)
    kl = matched_kl(a, a_kl, b, b_kl) if a_kl and b_kl else []
    return {"shared": {lr: _row(d) for lr, d in shared_lr(a, b).items()},
            "own_lr": {**_row(own), "folds": folds}, "in_sample": {**_row(naive), "lr_a": la, "lr_b": lb},
            "matched_kl": [{k: (_row(v) if k == "difference" else v) for k, v in r.items()} for r in kl]}  # fmt: skip


def _row(d: Difference) -> dict[str, Any]:
    return {"diff": d.diff, "lo": d.lo, "hi": d.hi, "p": d.p, "n": d.n_a, "test": d.test, "verdict": verdict(d)}


# --- several warm starts: choose on some warm starts, judge over the others ----------------------------


def _over_warm_starts(a: dict[Any, float], b: dict[Any, float], cluster_of: dict[Any, str]) -> dict[str, Any]:
    """analysis.clusters.cluster_contrast of per-unit values a - b (units paired within a warm start), as a
    row with n = warm starts and the ICC."""
    by_a: dict[str, dict[Any, float]] = defaultdict(dict)
    by_b: dict[str, dict[Any, float]] = defaultdict(dict)
    for u, v in a.items():
        by_a[cluster_of[u]][u] = v
    for u, v in b.items():
        by_b[cluster_of[u]][u] = v
    c = cluster_contrast(dict(by_a), dict(by_b))
    words = warm_start_verdict(c.difference())
    return {"diff": c.diff, "lo": c.lo, "hi": c.hi, "p": c.p, "n": c.warm_starts, "test": c.test,
            "var_between": c.var_between, "icc": c.icc, "verdict": words}  # fmt: skip


def compare_arms_clustered(a: Grid, b: Grid, a_kl: Grid | None, b_kl: Grid | None,
                           cluster_of: dict[Any, str]) -> dict[str, Any]:  # fmt: skip
    """compare_arms for a sweep over warm starts (units keyed by `cluster_of`, unit -> warm start): every
    contrast is a t over warm starts (analysis.clusters), and the own-lr folds split the warm starts, not
    the units, so no warm start both chooses an lr and is scored at it."""
    units = _seeds(a, b)
    warm = sorted({cluster_of[u] for u in units})
    shared = {lr: _over_warm_starts({u: a[lr][u] for u in units}, {u: b[lr][u] for u in units}, cluster_of)
              for lr in sorted(set(a) & set(b))}  # fmt: skip
    da, db, folds = {}, {}, []
    for tune_w, eval_w in halves(warm):
        tune = [u for u in units if cluster_of[u] in tune_w]
        scored = [u for u in units if cluster_of[u] in eval_w]
        if not tune or not scored:
            continue
        la, lb = best_lr(a, tune), best_lr(b, tune)
        folds.append({"tune": sorted(tune_w), "evaluate": sorted(eval_w), "lr_a": la, "lr_b": lb})
        da.update({u: a[la][u] for u in scored})
        db.update({u: b[lb][u] for u in scored})
    la, lb = (best_lr(a, units), best_lr(b, units)) if units else (math.nan, math.nan)
    naive = _over_warm_starts({u: a[la][u] for u in units} if units else {},
                              {u: b[lb][u] for u in units} if units else {}, cluster_of)
    kl_rows = []
    kl_units = _seeds(a, b, a_kl, b_kl) if a_kl and b_kl else []
    for lr in sorted(set(a_kl) & set(b_kl)) if len(kl_units) >= 2 else []:
        kappa = math.sqrt(np.mean([a_kl[lr][u] for u in kl_units]) * np.mean([b_kl[lr][u] for u in kl_units]))
        ka, kb = lr_at_kl(a_kl, kappa, kl_units), lr_at_kl(b_kl, kappa, kl_units)
        if math.isfinite(ka) and math.isfinite(kb):
            kl_rows.append({"kl": kappa, "at_lr": lr, "lr_a": ka, "lr_b": kb, "difference": _over_warm_starts(
                {u: value_at_lr(a, ka, u) for u in kl_units}, {u: value_at_lr(b, kb, u) for u in kl_units}, cluster_of)})
    return {"shared": shared, "own_lr": {**_over_warm_starts(da, db, cluster_of), "folds": folds},
            "in_sample": {**naive, "lr_a": la, "lr_b": lb}, "matched_kl": kl_rows}  # fmt: skip


# --- from runs, and from a committed table.json ------------------------------------------------------


def _outcome(runs: list[Run]):
    if has_expected(runs):
        return "expected-acc AUC", auc
    if all(math.isfinite(final_eval(r)) for r in runs):
        return "final eval accuracy", final_eval
    return "final reward", final_reward


def arms_from_runs(
    runs: list[Run], fields: list[str]
) -> tuple[str, dict[str, Grid], dict[str, Grid], dict[str, str] | None]:
    """(outcome name, {arm: outcome grid}, {arm: KL grid}, unit -> warm start or None); an arm is a group
    label less its lr. With several warm starts (analysis.clusters) a unit is "(warm start, seed)" and the
    last entry maps it to its warm start; else units are seeds and it is None."""
    others = [f for f in fields if f != LR]
    name, per_run = _outcome(runs)
    clustered = detect_design(runs).kind == CLUSTERED
    cluster_of: dict[str, str] = {}
    out: dict[str, Grid] = defaultdict(lambda: defaultdict(dict))
    kl: dict[str, Grid] = defaultdict(lambda: defaultdict(dict))
    for run in runs:
        flat = run.flat
        arm = " ".join([run.base_label, *(f"{f.rsplit('.', 1)[-1]}={flat.get(f)}" for f in others)])
        lr = float(flat[LR])
        key = unit_key(run, clustered)
        if clustered:
            cluster_of[key] = repr(unit(run)[0])
        out[arm][lr][key] = float(per_run(run))
        kl[arm][lr][key] = run.mean(KL)
    return (name, {k: dict(v) for k, v in out.items()}, {k: dict(v) for k, v in kl.items()},
            cluster_of if clustered else None)


_LR_IN_LABEL = re.compile(r" lr=([0-9.eE+-]+)")


def arms_from_table(table: dict[str, Any]) -> tuple[str, dict[str, Grid], dict[str, Grid]]:
    """The same from a table.json that moe-rl-analyze wrote: per-seed AUC ("outcomes") or final eval
    accuracy ("summary") and per-update KL ("step_size"), arms from the group labels less " lr=..."."""
    out: dict[str, Grid] = defaultdict(dict)
    kl: dict[str, Grid] = defaultdict(dict)
    source = table.get("outcomes") or table["summary"]
    name, column = ("expected-acc AUC", "auc") if table.get("outcomes") else ("final eval accuracy", "final eval acc")
    for label, row in source.items():
        m = _LR_IN_LABEL.search(label)
        if m is None:
            continue
        arm, lr = (label[: m.start()] + label[m.end():]).strip(), float(m.group(1))
        out[arm][lr] = dict(zip(row["per_seed"]["seed"], map(float, row["per_seed"][column]), strict=True))
        step = (table.get("step_size") or {}).get(label)
        if step:
            kl[arm][lr] = dict(zip(step["per_seed"]["seed"], map(float, step["per_seed"]["per-update KL"]), strict=True))
    return name, dict(out), dict(kl)


def comparable_arms(arms: dict[str, Grid]) -> list[tuple[str, str]]:
    """Pairs of arms that share every field but the objective / replay (same text after the base label)
    and at least MIN_LRS lrs."""
    def setting(arm: str) -> str:
        return arm.split(")", 1)[1].strip()  # the base label ends at "(replay=...)"

    names = sorted(arms, key=lambda s: (setting(s), s))
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if setting(a) == setting(b) and len(set(arms[a]) & set(arms[b])) >= MIN_LRS]  # fmt: skip


def steplr_table(name: str, arms: dict[str, Grid], kls: dict[str, Grid],
                 cluster_of: dict[Any, str] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """compare_arms (compare_arms_clustered when units map to warm starts) for every comparable pair of
    arms: [{"a", "b", "outcome", ...}]."""
    def one(a: str, b: str) -> dict[str, Any]:
        if cluster_of is None:
            return compare_arms(arms[a], arms[b], kls.get(a), kls.get(b))
        return compare_arms_clustered(arms[a], arms[b], kls.get(a), kls.get(b), cluster_of)

    return [{"a": a, "b": b, "outcome": name, **one(a, b)} for a, b in comparable_arms(arms)]


def applies(fields: list[str], runs: list[Run]) -> bool:
    """Whether the sweep varies the lr over at least MIN_LRS values."""
    return LR in fields and len({float(r.flat[LR]) for r in runs}) >= MIN_LRS


def _n(x: float, fmt: str = "+.3f") -> str:
    return f"{x:{fmt}}" if math.isfinite(x) else "n/a"


def _ci(r: dict[str, Any]) -> str:
    return f"{_n(r['diff'])} [{_n(r['lo'])}, {_n(r['hi'])}]"


def format_steplr(table: list[dict[str, Any]]) -> str:
    """Markdown, per pair of arms: one table of the contrasts, then a sentence on each."""
    if not table:
        return "No two arms share every other varying field at three or more lrs: no own-lr contrast."
    parts = []
    for pair in table:
        lines = [f"**{pair['a']}** − **{pair['b']}** ({pair['outcome']}):", "",
                 "| contrast | lr (a, b) | estimate [95% CI] | p | seeds |", "|---|---|---|---|---|"]  # fmt: skip
        for lr, r in pair["shared"].items():
            lines.append(f"| shared lr | {lr:g} | {_ci(r)} | {_n(r['p'], '.3g')} | {r['n']} |")
        own = pair["own_lr"]
        chosen = "; ".join(f"{f['lr_a']:g}, {f['lr_b']:g}" for f in own["folds"])
        lines.append(f"| own best lr, cross-fitted | {chosen} | {_ci(own)} | {_n(own['p'], '.3g')} | {own['n']} |")
        ins = pair["in_sample"]
        lines.append(f"| own best lr, in sample (biased) | {ins['lr_a']:g}, {ins['lr_b']:g} | {_ci(ins)} "
                     f"| {_n(ins['p'], '.3g')} | {ins['n']} |")
        for r in pair["matched_kl"]:
            d = r["difference"]
            lines.append(f"| matched KL {r['kl']:.2g} | {r['lr_a']:.3g}, {r['lr_b']:.3g} | {_ci(d)} "
                         f"| {_n(d['p'], '.3g')} | {d['n']} |")
        lines += ["", f"- At its own best lr (cross-fitted): {_ci(own)}: {own['verdict']}."]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


SECTION = Section(
    name="own_lr",
    heading="Each objective at its own step size",
    intro=doc_intro(__doc__),
    file="own_lr.md",
    applies=lambda sweep: applies(sweep.fields, sweep.runs),
    compute=lambda sweep: steplr_table(*arms_from_runs(sweep.runs, sweep.fields)),
    markdown=format_steplr,
)


def main(argv: list[str] | None = None) -> None:
    """`python -m analysis.steplr TABLE.json`: the own-lr contrasts of a committed report, as markdown."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m analysis.steplr path/to/table.json")
    table = json.loads(Path(args[0]).read_text())
    print(format_steplr(steplr_table(*arms_from_table(table))))


if __name__ == "__main__":
    main()
