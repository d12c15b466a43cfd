"""A dose crossed with the arms: each arm's dose effect and the difference in differences, by warm start.

When a sweep crosses the objective arms with a dose that acts on every arm alike (FACTORS:
`trainer.router_lr_scale`, the router's own learning rate, whose re-routing the replay arms' policies
undergo too; `rollout.staleness`, the versions between the sampler and the trainer), the question is not whether an arm is worse at the high dose but whether the dose costs it
more than it costs another arm. Unlike the noise-dose section (analysis.drift), no arm is taken as
dose-free: every arm runs at every level, and every contrast pairs runs of one unit.

Per run, the outcome y is the expected-accuracy AUC (analysis.outcomes.auc) where the runs logged it,
else the final held-out accuracy. A unit u is (warm start, RL seed) in a sweep over several warm starts
with RL seeds on each (analysis.clusters, CLUSTERED), else the RL seed. With l the lowest level of the
dose and h a higher one:

| contrast | per unit | judged by |
|---|---|---|
| dose effect of arm a at h | e_a,u(h) = y_a,u(h) − y_a,u(l) | the mean over a warm start's seeds, then a Student t over warm starts (analysis.clusters.cluster_contrast), with σ² between, σ² within and the ICC |
| difference in differences, a against b at h | D_ab,u(h) = e_a,u(h) − e_b,u(h) | the same |

A D below 0 says the dose costs a more than b. In a sweep of one warm start the t runs over RL seeds and
is conditional on that warm start (each seed is then its own cluster, so no ICC is given).

When the sweep also varies `trainer.lr`, the contrasts above are formed at each lr (arms paired at one
shared lr), and, with at least analysis.steplr.MIN_LRS lrs, once more with **each (arm, level) at its own
best lr, cross-fitted**: the clusters (warm starts, or seeds in a one-warm-start sweep), sorted, are split
into two folds (alternate clusters); on one fold each (arm, level)'s best lr is the argmax of its mean y
over the fold's runs (ties: the smaller lr), and the other fold's units are scored at it; then the folds
swap. Every unit is scored once, at lrs that its own cluster did not help choose, so picking the maximum
does not inflate the contrast (the interval does not carry the variance of the choice). The chosen lrs are
reported per fold, with a flag where one lies at the grid's edge (the grid did not bracket that best).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from analysis.clusters import CLUSTERED, MIN_WARM_STARTS, cluster_contrast, detect_design, warm_start_id
from analysis.compare import last_value
from analysis.load import Run, group_label, sort_key
from analysis.outcomes import auc, has_expected
from analysis.sections import Section, Sweep, doc_intro
from analysis.stats import MIN_SEEDS, verdict
from analysis.steplr import LR, MIN_LRS

FACTORS = ("trainer.router_lr_scale", "rollout.staleness")
"""Doses that act on every arm (the replay arms included), so that each arm needs its own runs at each level."""
LEVEL_PREFIX = {"trainer.router_lr_scale": "x", "rollout.staleness": "k="}
"""How a level is written in the tables: x30 for a router lr scale, k=8 for a staleness."""

Values = dict[tuple, dict[int, float]]
"""{cluster: {RL seed: value}}, as analysis.clusters.cluster_contrast takes them."""


def factor_field(fields: Sequence[str], runs: Sequence[Run]) -> str | None:
    """The first of FACTORS that the sweep varies over two or more levels, else None."""
    for field in FACTORS:
        if field in fields and len({run.flat.get(field) for run in runs}) >= 2:
            return field
    return None


def outcome_of(runs: Sequence[Run]) -> tuple[str, Callable[[Run], float]]:
    """(name, per-run value): the expected-acc AUC where logged, else the last held-out accuracy."""
    if has_expected(list(runs)):
        return "expected-acc AUC", auc
    return "final eval acc", lambda run: last_value(run.rows, "eval/accuracy")


def cells(runs: Sequence[Run], factor: str, others: Sequence[str], clustered: bool,
          y: Callable[[Run], float]) -> dict[str, dict[Any, Values]]:
    """{arm: {level: {cluster: {seed: y}}}}; an arm is the group label without the factor, a cluster the
    warm start (CLUSTERED) or the seed itself (each seed its own cluster, value under seed 0)."""
    out: dict[str, dict[Any, Values]] = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for run in runs:
        key, seed = ((warm_start_id(run), run.seed) if clustered else ((run.seed,), 0))
        out[group_label(run, list(others))][run.flat.get(factor)][key][seed] = float(y(run))
    return out


def effect(high: Values, low: Values) -> Values:
    """Per unit, high − low, over the units both levels ran with a finite value."""
    out: Values = {}
    for w in high.keys() & low.keys():
        shared = {s: high[w][s] - low[w][s] for s in high[w].keys() & low[w].keys()
                  if math.isfinite(high[w][s]) and math.isfinite(low[w][s])}
        if shared:
            out[w] = shared
    return out


def _row(kind: str, a: str, b: str | None, level: Any, low: Any, values_a: Values, values_b: Values,
         clustered: bool) -> dict[str, Any]:
    c = cluster_contrast(values_a, values_b)
    unit, least = ("warm start(s)", MIN_WARM_STARTS) if clustered else ("seed(s)", MIN_SEEDS)
    return {"kind": kind, "a": a, "b": b, "level": level, "low": low, "diff": c.diff, "lo": c.lo, "hi": c.hi,
            "p": c.p, "clusters": c.warm_starts, "runs": c.runs, "var_between": c.var_between,
            "var_within": c.var_within, "icc": c.icc, "per_cluster": list(c.per_warm_start),
            "verdict": verdict(c.difference(), min_seeds=least).replace("seed(s)", unit)}  # fmt: skip


def interaction_rows(table: dict[str, dict[Any, Values]], clustered: bool, lr: Any = None) -> list[dict[str, Any]]:
    """Each arm's dose effect at every level above its lowest and every pair of arms' difference in
    differences, from {arm: {level: values}}; each row carries `lr` (a number, "own" or None)."""
    rows = []
    effects: dict[str, dict[Any, Values]] = {}
    lows: dict[str, Any] = {}
    for arm, by_level in table.items():
        low, *highs = sorted(by_level, key=sort_key)
        lows[arm], effects[arm] = low, {h: effect(by_level[h], by_level[low]) for h in highs}
        for h, e in effects[arm].items():
            zero = {w: dict.fromkeys(seeds, 0.0) for w, seeds in e.items()}
            rows.append(_row("dose effect", arm, None, h, low, e, zero, clustered))
    for a, b in itertools.combinations(effects, 2):
        for h in sorted(effects[a].keys() & effects[b].keys(), key=sort_key):
            rows.append(_row("difference in differences", a, b, h, lows[a], effects[a][h], effects[b][h], clustered))
    return [{**r, "lr": lr} for r in rows]


def best_lr(by_lr: dict[float, Values], clusters: Sequence[tuple]) -> float:
    """The lr whose mean y over the runs of `clusters` is highest (the smaller lr on a tie); nan if none ran."""
    means = {}
    for lr, values in by_lr.items():
        ys = [v for w in clusters for v in values.get(w, {}).values() if math.isfinite(v)]
        if ys:
            means[lr] = sum(ys) / len(ys)
    return max(means, key=lambda lr: (means[lr], -lr)) if means else math.nan


def own_lr_cells(by_lr: dict[float, dict[str, dict[Any, Values]]]) -> tuple[dict[str, dict[Any, Values]], list[dict]]:
    """Cross-fitted own-lr cells (module docstring) from {lr: {arm: {level: values}}}: ({arm: {level:
    values at the lr its other fold chose}}, [{"tune", "score", "chosen": {(arm, level): lr}}] per fold)."""
    clusters = sorted({w for t in by_lr.values() for lv in t.values() for v in lv.values() for w in v}, key=repr)
    folds = [(clusters[0::2], clusters[1::2]), (clusters[1::2], clusters[0::2])]
    cells_of = {(arm, level) for t in by_lr.values() for arm, lv in t.items() for level in lv}
    out: dict[str, dict[Any, Values]] = defaultdict(lambda: defaultdict(dict))
    chosen = []
    for tune, score in folds:
        if not tune or not score:
            continue
        picks = {}
        for arm, level in sorted(cells_of, key=lambda c: (c[0], sort_key(c[1]))):
            grid = {lr: t[arm][level] for lr, t in by_lr.items() if level in t.get(arm, {})}
            picks[arm, level] = lr = best_lr(grid, tune)
            if math.isfinite(lr):
                out[arm][level].update({w: grid[lr][w] for w in score if w in grid[lr]})
        chosen.append({"tune": tune, "score": score, "chosen": picks})
    return out, chosen


def dose_interaction(sweep: Sweep) -> dict[str, Any] | None:
    """Each arm's dose effect and every pair of arms' difference in differences at each level above the
    lowest, at each lr and (with MIN_LRS lrs or more) at each (arm, level)'s own cross-fitted lr (module
    docstring); None when the sweep varies no FACTORS field or runs one arm."""
    factor = factor_field(sweep.fields, sweep.runs)
    if factor is None:
        return None
    others = [f for f in sweep.fields if f not in (factor, LR)]
    clustered = detect_design(sweep.runs).kind == CLUSTERED
    name, y = outcome_of(sweep.runs)
    varies_lr = LR in sweep.fields
    lrs = sorted({float(r.flat[LR]) for r in sweep.runs}) if varies_lr else [None]
    by_lr = {lr: cells([r for r in sweep.runs if lr is None or float(r.flat[LR]) == lr], factor, others, clustered, y)
             for lr in lrs}  # fmt: skip
    rows = [row for lr in lrs for row in interaction_rows(by_lr[lr], clustered, lr)]
    if not any(r["kind"] == "difference in differences" for r in rows):
        return None
    result = {"factor": factor, "outcome": name, "clustered": clustered, "rows": rows}
    if varies_lr and len(lrs) >= MIN_LRS:
        own, folds = own_lr_cells(by_lr)
        edges = sorted({f"{arm} {LEVEL_PREFIX.get(factor, '')}{level:g}" for fold in folds
                        for (arm, level), lr in fold["chosen"].items() if lr in (lrs[0], lrs[-1])})  # fmt: skip
        result["own_lr"] = {"rows": interaction_rows(own, clustered, "own"), "grid": lrs, "at_edge": edges,
                            "folds": [{"tune": [repr(w) for w in f["tune"]], "score": [repr(w) for w in f["score"]],
                                       "chosen": [{"arm": a, "level": lv, "lr": lr} for (a, lv), lr in f["chosen"].items()]}
                                      for f in folds]}  # fmt: skip
    return result


def _num(x: float, fmt: str = ".3g") -> str:
    return f"{x:{fmt}}" if math.isfinite(x) else "n/a"


def _lr(lr: Any) -> str:
    return "own (cross-fitted)" if lr == "own" else f"{lr:g}"


def _table(rows: list[dict[str, Any]], f: str, unit: str, with_lr: bool) -> tuple[list[str], list[str]]:
    """The markdown table and the one-line verdicts of interaction rows."""
    x = LEVEL_PREFIX.get(f, f"{f}=")
    lr_head, lr_rule = ("| lr ", "|---") if with_lr else ("", "")
    lines = [f"| contrast {lr_head}| at {f} | estimate | 95% CI (t over {unit}) | p | {unit} | runs | σ² between | ICC |",
             "|---" * 9 + lr_rule + "|"]  # fmt: skip
    words = []
    for r in rows:
        what = (f"{r['a']}: {x}{r['level']:g} − {x}{r['low']:g}" if r["b"] is None
                else f"[{r['a']}] − [{r['b']}], each {x}{r['level']:g} − {x}{r['low']:g}")
        lr = f"| {_lr(r['lr'])} " if with_lr else ""
        at = f" at lr {_lr(r['lr'])}" if with_lr else ""
        lines.append(f"| {what} {lr}| {r['level']:g} | {_num(r['diff'], '+.3g')} | [{_num(r['lo'])}, {_num(r['hi'])}] "
                     f"| {_num(r['p'])} | {r['clusters']} | {r['runs']} | {_num(r['var_between'])} "
                     f"| {_num(r['icc'], '.2f')} |")
        words.append(f"- {r['kind']}, {what}{at}: {_num(r['diff'], '+.3g')} [{_num(r['lo'])}, {_num(r['hi'])}]: "
                     f"{r['verdict']}.")
    return lines, words


def format_interaction(result: dict[str, Any]) -> str:
    """Markdown: the dose effects, then the differences in differences, each with its interval and words;
    then, when the sweep varies the lr over enough values, the same with each (arm, level) at its own lr."""
    f, unit = result["factor"], ("warm starts" if result["clustered"] else "seeds (one warm start)")
    x = LEVEL_PREFIX.get(f, f"{f}=")
    with_lr = any(r["lr"] is not None for r in result["rows"])
    lines, words = _table(result["rows"], f, unit, with_lr)
    note = (f"Outcome: {result['outcome']} per run. A dose effect is an arm's outcome at the level less at "
            f"{x}{result['rows'][0]['low']:g}, paired within a unit; a difference in differences is one arm's "
            "dose effect less another's (below 0: the dose costs the first arm more). "
            + ("Per warm start the mean over its RL seeds, then a Student t over warm starts; σ² between and "
               "the ICC as in analysis.clusters." if result["clustered"] else
               "A paired t over RL seeds, conditional on one warm start.")
            + (" Rows at one lr pair the arms at that shared lr." if with_lr else ""))
    parts = ["\n".join(lines), note, "\n".join(words)]
    own = result.get("own_lr")
    if own:
        o_lines, o_words = _table(own["rows"], f, unit, False)
        picks = []
        for i, fold in enumerate(own["folds"], 1):
            chosen = ", ".join(f"{c['arm']} {x}{c['level']:g}: {c['lr']:g}" for c in fold["chosen"])
            picks.append(f"- fold {i}: chosen on {', '.join(fold['tune'])}, scored on {', '.join(fold['score'])}: "
                         f"{chosen}")
        edge = (f"At the grid's edge ({own['grid'][0]:g} or {own['grid'][-1]:g}) in some fold, so the grid may not "
                f"bracket their best: {', '.join(own['at_edge'])}." if own["at_edge"] else
                "Every chosen lr lies inside the grid.")
        parts += ["**Each (arm, level) at its own lr, cross-fitted** (lrs chosen on one fold of "
                  f"{'warm starts' if result['clustered'] else 'seeds'}, scored on the other, then swapped; grid "
                  f"{', '.join(f'{lr:g}' for lr in own['grid'])}):",
                  "\n".join(o_lines), "\n".join(picks), edge, "\n".join(o_words)]
    return "\n\n".join(parts)


SECTION = Section(
    name="dose_interaction",
    heading="Dose effects and differences in differences",
    intro=doc_intro(__doc__).split("\n\n")[0],
    file="dose_interaction.md",
    applies=lambda sweep: factor_field(sweep.fields, sweep.runs) is not None,
    compute=dose_interaction,
    markdown=format_interaction,
)
