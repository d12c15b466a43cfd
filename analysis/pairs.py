"""Pairwise comparisons of groups in one sweep: is a difference distinguishable from seed noise?

Two groups are compared when their runs agree on every config field that varies in the sweep (lr,
num_layers, ...) and differ only in objective preset / replay source, so a pair never confounds the
objective with a swept setting. For each pair (a, b), in group order:

| outcome | per seed | difference a - b | test |
|---|---|---|---|
| final eval accuracy (or final reward when some run has no held-out eval) | `eval/accuracy` of the last row that has it; else mean `rollout/reward/mean` over the last 5 steps | mean of the per-seed differences when both groups ran the same seeds (a seed's warm start and eval set are shared by every group, so pairing removes the between-seed spread), else difference of means; 95% CI | paired t when paired, else Welch's t; two-sided |
| collapse rate | 1 if the run logged any collapse event (`collapse/events` > 0 at its last step), else 0 | difference of rates, 95% Newcombe hybrid score CI | permutation test of the rate difference, two-sided (exact when the splits number at most `permutations`, else that many seeded random splits) |
| expected-acc AUC (runs with `eval/expected_accuracy` only) | mean expected accuracy over training (analysis.outcomes.auc) | as for the outcome: paired by seed when possible; 95% CI | paired t, else Welch |
| time to sustained regression (same runs) | first eval below 0.8 x the pre-update expected accuracy at two evals in a row, else censored at the last eval (analysis.outcomes) | regressed seeds per arm | log-rank test (arms as independent samples) |

Warm starts (analysis.clusters): the section opens with the sweep's design. When several warm starts each
carry RL seeds, every pair also gets the outcome (and AUC, and late expected accuracy) contrast formed within each warm start and
judged by a t over warm starts, with the between-warm-start variance component and the ICC ("clusters"),
and sustained regression stratified by warm start: the exact conditional test of the rates and the
stratified log-rank test of the times (analysis.outcomes.stratified_regression_test); and runs that *end*
regressed (late expected accuracy below 0.8 x the pre-update value), by the same exact stratified test
(analysis.outcomes.stratified_ends_test): a sustained regression can be a dip the run recovers from.

table.json keeps, per pair, every seed's value of each outcome (`per_seed`), so any number can be re-derived.

Each difference gets a sentence from analysis.stats.verdict: distinguishable from noise at 5% or not,
or "no verdict possible" when a group has fewer than 5 seeds.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from analysis.clusters import CLUSTERED, Design, contrast_row, detect_design, format_clusters, unit
from analysis.compare import last_value
from analysis.load import Run
from analysis.outcomes import (
    REGRESSION_FRAC,
    auc,
    format_regression,
    has_expected,
    late_expected,
    regression_test,
    stratified_ends_test,
    stratified_regression_test,
)
from analysis.stats import MIN_SEEDS, Difference, paired_t, rate_difference, verdict, welch

Groups = dict[str, list[Run]]


def collapsed(run: Run) -> bool:
    """Whether the run logged at least one collapse event (`collapse/events` at its last step > 0)."""
    return run.last("collapse/events", 0.0) > 0


def final_eval(run: Run) -> float:
    """`eval/accuracy` in the run's last row that has it; nan when the run has no held-out eval."""
    return last_value(run.rows, "eval/accuracy")


def final_reward(run: Run) -> float:
    """The summary table's final reward: mean `rollout/reward/mean` over the last 5 steps."""
    return run.summary()["final reward"]


def outcome_difference(a: list[Run], b: list[Run], per_seed=final_eval) -> Difference:
    """`per_seed(run)` of a minus b: paired t over units (warm start, RL seed) when both groups ran the same
    units once, else Welch. With several warm starts this treats every unit as independent; the cluster
    contrast (analysis.clusters) is the one to judge by there."""
    by_a, by_b = {unit(r): r for r in a}, {unit(r): r for r in b}
    if len(by_a) == len(a) and len(by_b) == len(b) and set(by_a) == set(by_b):
        units = sorted(by_a, key=repr)
        return paired_t([per_seed(by_a[u]) for u in units], [per_seed(by_b[u]) for u in units])
    return welch([per_seed(r) for r in a], [per_seed(r) for r in b])


def comparable_pairs(groups: Groups, fields: list[str]) -> list[tuple[str, str]]:
    """Pairs of group labels whose runs share the values of every varying field, in group order."""
    setting = {label: tuple(str(runs[0].flat.get(f)) for f in fields) for label, runs in groups.items()}
    return [(a, b) for a, b in itertools.combinations(groups, 2) if setting[a] == setting[b]]


def _row(d: Difference) -> dict[str, Any]:
    # Equal means can differ by float rounding (3e-18): show such a difference as the 0 it is.
    scale = max([1.0] + [abs(x) for x in (d.lo, d.hi) if math.isfinite(x)])
    diff = 0.0 if abs(d.diff) < 1e-12 * scale else d.diff
    return {"diff": diff, "lo": d.lo, "hi": d.hi, "p": d.p, "test": d.test, "n_a": d.n_a, "n_b": d.n_b,
            "verdict": verdict(d)}  # fmt: skip


def compare_pair(
    a: list[Run], b: list[Run], permutations: int = 10_000, seed: int = 0, clustered: bool = False
) -> dict[str, Any]:
    """Outcome and collapse-rate differences a - b, each with its CI, p-value and verdict; with
    `clustered`, also the outcome (and AUC) contrast over warm starts with its ICC (analysis.clusters)."""
    use_eval = all(math.isfinite(final_eval(r)) for r in a + b)
    per_seed = final_eval if use_eval else final_reward
    outcome = outcome_difference(a, b, per_seed)
    rate = rate_difference([collapsed(r) for r in a], [collapsed(r) for r in b], permutations, seed)
    expected = has_expected(a + b)
    quantities = {"outcome": per_seed, "collapsed": collapsed, **({"auc": auc} if expected else {})}
    return {
        "outcome": "final eval accuracy" if use_eval else "final reward",
        "outcome_diff": _row(outcome),
        "collapse_rate": {"a": sum(map(collapsed, a)) / len(a), "b": sum(map(collapsed, b)) / len(b)},
        "collapse_diff": _row(rate),
        "auc_diff": _row(outcome_difference(a, b, auc)) if expected else None,
        "regression": regression_test(a, b) if expected else None,
        "clusters": ({"outcome": contrast_row(a, b, per_seed),
                      **({"auc": contrast_row(a, b, auc), "late": contrast_row(a, b, late_expected)} if expected else {})}
                     if clustered else None),
        "regression_by_warm_start": stratified_regression_test(a, b) if clustered and expected else None,
        "ends_by_warm_start": stratified_ends_test(a, b) if clustered and expected else None,
        "per_seed": {"a": per_seed_values(a, quantities), "b": per_seed_values(b, quantities)},
    }


def per_seed_values(runs: list[Run], quantities: dict[str, Any]) -> dict[str, list]:
    """{"seed": [seeds], name: [quantity(run) per run, in the same order]} for table.json; with more than one
    warm start also "warm_start": [its build seed per run] (analysis.clusters.warm_start_id's first entry)."""
    out = {"seed": [r.seed for r in runs]}
    if detect_design(runs).kind == CLUSTERED:
        out["warm_start"] = [unit(r)[0][0] for r in runs]
    return {**out, **{name: [float(fn(r)) for r in runs] for name, fn in quantities.items()}}


def check_pairs(groups: Groups, extra: tuple[tuple[str, str], ...]) -> None:
    """Raises ValueError naming each label of `extra` that is not a group (and the groups there are), or a
    pair of a group with itself."""
    unknown = [label for pair in extra for label in pair if label not in groups]
    if unknown:
        raise ValueError(f"--pair: no group {', '.join(map(repr, unknown))}; the groups are "
                         f"{', '.join(map(repr, groups))}")
    same = [a for a, b in extra if a == b]
    if same:
        raise ValueError(f"--pair {same[0]!r} {same[0]!r}: a group against itself compares nothing; name two groups")


def pairwise(
    groups: Groups, fields: list[str], permutations: int = 10_000, seed: int = 0,
    extra: tuple[tuple[str, str], ...] = (),
) -> list[dict]:
    """compare_pair for every comparable pair, then for each `extra` pair of labels not among them (groups
    that differ in a varying field, such as each objective at its own lr): [{"a": label, "b": label, ...}];
    cluster contrasts when the sweep's design (analysis.clusters.detect_design over all its runs) is
    clustered. Raises ValueError naming an `extra` label that is not a group, and the groups there are."""
    check_pairs(groups, extra)
    same = comparable_pairs(groups, fields)
    named = [p for p in dict.fromkeys(extra) if p not in same and p[::-1] not in same and p[0] != p[1]]
    clustered = detect_design([r for runs in groups.values() for r in runs]).kind == CLUSTERED
    return [
        {"a": a, "b": b, **compare_pair(groups[a], groups[b], permutations, seed, clustered)}
        for a, b in same + named
    ]


def _num(x: float, fmt: str = ".3g") -> str:
    return f"{x:{fmt}}" if math.isfinite(x) else "n/a"


def _ci(row: dict[str, Any]) -> str:
    return f"[{_num(row['lo'])}, {_num(row['hi'])}]"


def format_pairs(pairs: list[dict], design: Design | None = None) -> str:
    """Markdown: the design's sentence (analysis.clusters) when given, one table row per pair and difference,
    one sentence per difference, then the cluster contrasts when the design is clustered."""
    if not pairs:
        return "No two groups share the values of every varying config field, so no pair is compared."
    head = [design.sentence()] if design is not None else []
    tail = ["### Warm starts as clusters", format_clusters(pairs)] if any(p.get("clusters") for p in pairs) else []
    lines = [
        "| a | b | difference (a - b) | estimate | 95% CI | test | p | seeds (a, b) |",
        "|---" * 8 + "|",
    ]
    words = []
    for pair in pairs:
        a, b = pair["a"], pair["b"]
        for name, key in ((pair["outcome"], "outcome_diff"), ("collapse rate", "collapse_diff"),
                          ("expected-acc AUC", "auc_diff")):
            row = pair.get(key)
            if row is None:
                continue
            lines.append(
                f"| {a} | {b} | {name} | {_num(row['diff'], '+.3g')} | {_ci(row)} | {row['test']} "
                f"| {_num(row['p'])} | {row['n_a']}, {row['n_b']} |"
            )
            words.append(
                f"- **{a}** vs **{b}**, {name}: {_num(row['diff'], '+.3g')} {_ci(row)}: {row['verdict']}."
            )
        if pair.get("regression") is not None:
            reg = pair["regression"]
            lines.append(
                f"| {a} | {b} | time to sustained regression | regressed {reg['regressed_a']}/{reg['n_a']} vs "
                f"{reg['regressed_b']}/{reg['n_b']} | – | {reg['test']} | {_num(reg['p'])} | {reg['n_a']}, {reg['n_b']} |"
            )
            words.append(f"- **{a}** vs **{b}**, time to sustained regression: {format_regression(reg)}: "
                         f"{regression_verdict(reg)}.")
    notes = (
        f"Outcome CI and p: a paired t-test over seeds when both groups ran the same seeds, else Welch's t "
        f"(unequal variances); the test column says which. Collapse rate: fraction of seeds with any collapse "
        f"event; CI: Newcombe's hybrid score interval; p: two-sided permutation test. Expected-acc AUC (runs "
        f"with `eval/expected_accuracy`): mean teacher-forced expected accuracy over training, tested as the "
        f"outcome; time to sustained regression: first eval below {REGRESSION_FRAC:g} x the pre-update value at "
        f"two evals in a row, censored otherwise, log-rank test. A verdict needs at least {MIN_SEEDS} seeds per group."
    )
    warn = [p for p in pairs if min(p["outcome_diff"]["n_a"], p["outcome_diff"]["n_b"]) < MIN_SEEDS]
    parts = [*head, "\n".join(lines), notes, "\n".join(words), *tail]
    if warn:
        parts.insert(
            0,
            f"**Warning:** {len(warn)} of {len(pairs)} pairs have fewer than {MIN_SEEDS} seeds in a group: "
            "no verdict is possible for them; the numbers below only describe these seeds.",
        )
    return "\n\n".join(parts)


def regression_verdict(reg: dict[str, Any]) -> str:
    """analysis.stats.verdict for a log-rank result (regression_test's dict)."""
    return verdict(Difference(math.nan, math.nan, math.nan, reg["p"], reg["n_a"], reg["n_b"], reg["test"]))
