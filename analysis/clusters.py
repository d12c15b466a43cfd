"""Warm starts as clusters: a contrast between arms judged over independent warm starts, not over RL seeds.

Runs that start from one warm start share its policy, its router margins and its held-out eval set, so
they are not independent evidence about a method: a paired t over RL seeds of one warm start says what
the arms do *from that policy*, and nothing about the next one. A run's warm start is identified from
its config (`warm_start_id`): the seed that built it (`warmstart.build_seed`, or the run seed when that
is null: each run seed then builds its own), the model's init seed and the eval-set seed
(`warmstart.seed`); with `warmstart.enabled` false the start is the config-built model (`model.seed`).

The design of a sweep (`detect_design`):

| design | when | how a contrast is judged |
|---|---|---|
| one warm start | every run shares one warm start | today's paired t over RL seeds, labelled "conditional on one warm start" |
| one warm start per seed | each RL seed built its own (build_seed null) | today's paired t over seeds, which *is* a t over warm starts (one RL seed each), so warm-start and RL-seed variance cannot be told apart |
| clustered | some warm start carries two or more RL seeds and there are two or more warm starts | `cluster_contrast` below |

Cluster contrast of arms a and b (outcome y, warm start i = 1..k, RL seed j within it): the per-run
difference d_ij = y_a,ij − y_b,ij over the RL seeds both arms ran on warm start i (pairing within a warm
start); the warm start's contrast m_i = mean_j d_ij; the estimate is mean_i m_i (each warm start weighs
the same), with the Student t interval over the k warm starts (k − 1 dof) and its two-sided p. When the
arms ran different RL seeds on a warm start, m_i = mean(y_a,i) − mean(y_b,i) and no within-warm-start
variance is available.

Variance components beside every contrast: the one-way random-effects ANOVA estimator (method of
moments, Searle, Casella & McCulloch 1992, sec. 3.6) on the d_ij, with n_i seeds in warm start i,
N = Σ n_i, d̄ = Σ n_i m_i / N:

    MSB = Σ n_i (m_i − d̄)² / (k − 1),   MSW = Σ_i Σ_j (d_ij − m_i)² / (N − k),
    n0 = (N − Σ n_i² / N) / (k − 1),
    σ²_within = MSW,   σ²_between = max(0, (MSB − MSW) / n0)   (truncated at 0),
    ICC = σ²_between / (σ²_between + σ²_within).

σ²_between is the variance of the arm contrast across warm starts (the arm x warm-start interaction):
the part of the spread that more RL seeds on the same warm start can never average away. An ICC near 1
says the contrast is a property of the warm start; near 0, that RL seeds of one warm start already
vary as much as warm starts do. The estimate needs k ≥ 2 and N > k (nan otherwise).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats as sps

from analysis.load import Run
from analysis.stats import LEVEL, Difference, verdict

MIN_WARM_STARTS = 4
"""Fewer warm starts than this give no verdict on a cluster contrast (the issue's design asks for >= 4)."""

ONE = "one warm start"
PER_SEED = "one warm start per seed"
CLUSTERED = "clustered"


def warm_start_id(run: Run) -> tuple:
    """What identifies the policy a run starts RL from: (build seed, model init seed, eval-set seed), or
    ("no warm start", model seed) when the warm start is off."""
    flat = run.flat
    model_seed = flat.get("model.seed")
    if flat.get("warmstart.enabled") is False:
        return ("no warm start", model_seed)
    build = flat.get("warmstart.build_seed")
    return (run.seed if build is None else int(build), model_seed, flat.get("warmstart.seed"))


def unit(run: Run) -> tuple:
    """A run's experimental unit within an arm: (its warm start, its RL seed)."""
    return (warm_start_id(run), run.seed)


def unit_key(run: Run, clustered: bool) -> int | str:
    """The key a per-seed table files a run under: its seed, or repr(unit) when the sweep is CLUSTERED (a
    seed number then recurs on every warm start, and keying by it would merge different units)."""
    return repr(unit(run)) if clustered else run.seed


@dataclass(frozen=True)
class Design:
    """How a sweep's runs share warm starts."""

    kind: str
    """ONE, PER_SEED or CLUSTERED."""
    warm_starts: int
    """Distinct warm starts among the runs."""
    seeds_per_warm_start: tuple[int, ...]
    """Distinct RL seeds on each warm start, in warm-start order."""

    def sentence(self) -> str:
        """The report's line on what the pairwise differences are conditional on."""
        if self.kind == ONE:
            return ("Design: every run starts from **one warm start** (one policy and one eval set), so every "
                    "difference below is **conditional on one warm start**: its CI covers RL-seed noise from that "
                    "policy, not what another warm start would give.")
        if self.kind == PER_SEED:
            return (f"Design: each of the {self.warm_starts} RL seeds built its own warm start, so a paired t over "
                    "seeds is a t over warm starts with one RL seed each; warm-start and RL-seed variance are "
                    "not separable, and no ICC is given.")
        seeds = sorted(set(self.seeds_per_warm_start))
        per = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"
        return (f"Design: **{self.warm_starts} warm starts x {per} RL seeds**: every contrast is formed within a "
                f"warm start and judged by a t over warm starts (analysis.clusters), with the between-warm-start "
                f"variance and the ICC beside it, in the table \"Warm starts as clusters\". The first table pairs "
                f"(warm start, seed) units and treats them as independent: its intervals are too narrow whenever "
                f"the ICC is above 0.")


def detect_design(runs: Sequence[Run]) -> Design:
    """The sweep's design from its runs' configs (see the module docstring's table)."""
    seeds: dict[tuple, set[int]] = defaultdict(set)
    for run in runs:
        seeds[warm_start_id(run)].add(run.seed)
    per = tuple(len(seeds[w]) for w in sorted(seeds, key=repr))
    if len(seeds) == 1:
        kind = ONE
    elif max(per) >= 2:
        kind = CLUSTERED
    else:
        kind = PER_SEED
    return Design(kind, len(seeds), per)


@dataclass(frozen=True)
class ClusterContrast:
    """A contrast a - b over warm starts with its variance components."""

    diff: float
    lo: float
    hi: float
    p: float
    warm_starts: int
    runs: int
    var_between: float
    var_within: float
    icc: float
    per_warm_start: tuple[float, ...]
    test: str = "t over warm starts"

    def difference(self) -> Difference:
        """As an analysis.stats.Difference whose n is the number of warm starts (for `verdict`)."""
        return Difference(self.diff, self.lo, self.hi, self.p, self.warm_starts, self.warm_starts, self.test)


def variance_components(d_by_cluster: Sequence[Sequence[float]]) -> tuple[float, float, float]:
    """(σ²_between, σ²_within, ICC) of the one-way random-effects ANOVA estimator over clusters'
    finite values, σ²_between truncated at 0; nan where k < 2 or N <= k (module docstring)."""
    groups = [np.asarray(g, dtype=np.float64) for g in d_by_cluster]
    groups = [g[np.isfinite(g)] for g in groups]
    groups = [g for g in groups if g.size]
    k = len(groups)
    n_i = np.array([g.size for g in groups], dtype=np.float64)
    total = float(n_i.sum())
    if k < 2 or total <= k:
        return math.nan, math.nan, math.nan
    m_i = np.array([g.mean() for g in groups])
    grand = float((n_i * m_i).sum() / total)
    msb = float((n_i * (m_i - grand) ** 2).sum() / (k - 1))
    msw = float(sum(((g - g.mean()) ** 2).sum() for g in groups) / (total - k))
    n0 = (total - float((n_i**2).sum()) / total) / (k - 1)
    between = max(0.0, (msb - msw) / n0)
    icc = between / (between + msw) if between + msw > 0 else math.nan
    return between, msw, icc


def cluster_contrast(
    a: dict[tuple, dict[int, float]], b: dict[tuple, dict[int, float]], level: float = LEVEL
) -> ClusterContrast:
    """Contrast a - b from {warm start: {RL seed: value}} per arm: pair seeds within a warm start, average
    them to one contrast per warm start, t interval over warm starts; variance components of the paired
    differences (warm starts where the arms share no seed give a cluster mean but no within variance)."""
    means, paired = [], []
    runs = 0
    for w in sorted(set(a) & set(b), key=repr):
        va = {s: v for s, v in a[w].items() if math.isfinite(v)}
        vb = {s: v for s, v in b[w].items() if math.isfinite(v)}
        if not va or not vb:
            continue
        shared = sorted(set(va) & set(vb))
        if shared:
            d = [va[s] - vb[s] for s in shared]
            paired.append(d)
            means.append(float(np.mean(d)))
            runs += len(shared)
        else:
            means.append(float(np.mean(list(va.values())) - np.mean(list(vb.values()))))
            runs += min(len(va), len(vb))
    m = np.asarray(means, dtype=np.float64)
    k = int(m.size)
    between, within, icc = variance_components(paired) if len(paired) == k else (math.nan,) * 3
    est = float(m.mean()) if k else math.nan
    if k < 2 or np.ptp(m) == 0:
        return ClusterContrast(est, math.nan, math.nan, math.nan, k, runs, between, within, icc, tuple(means))
    se = float(m.std(ddof=1) / math.sqrt(k))
    half = float(sps.t.ppf((1 + level) / 2, k - 1) * se)
    p = float(2 * sps.t.sf(abs(est) / se, k - 1))
    return ClusterContrast(est, est - half, est + half, p, k, runs, between, within, icc, tuple(means))


def by_warm_start(runs: Sequence[Run], per_run: Callable[[Run], float]) -> dict[tuple, dict[int, float]]:
    """{warm start: {RL seed: per_run(run)}} for one arm's runs."""
    out: dict[tuple, dict[int, float]] = defaultdict(dict)
    for run in runs:
        out[warm_start_id(run)][run.seed] = float(per_run(run))
    return dict(out)


def warm_start_verdict(d: Difference) -> str:
    """stats.verdict of a contrast over warm starts: it counts warm starts, and needs MIN_WARM_STARTS of them."""
    return verdict(d, min_seeds=MIN_WARM_STARTS).replace("seed(s)", "warm start(s)")


def contrast_row(a: Sequence[Run], b: Sequence[Run], per_run: Callable[[Run], float]) -> dict[str, Any]:
    """cluster_contrast of per_run between two arms' runs, as a table.json row with its verdict."""
    c = cluster_contrast(by_warm_start(a, per_run), by_warm_start(b, per_run))
    return {"diff": c.diff, "lo": c.lo, "hi": c.hi, "p": c.p, "test": c.test, "warm_starts": c.warm_starts,
            "runs": c.runs, "var_between": c.var_between, "var_within": c.var_within, "icc": c.icc,
            "per_warm_start": list(c.per_warm_start),
            "verdict": warm_start_verdict(c.difference())}  # fmt: skip


def _num(x: float, fmt: str = ".3g") -> str:
    return f"{x:{fmt}}" if math.isfinite(x) else "n/a"


def format_clusters(pairs: list[dict]) -> str:
    """Markdown: one row per pair and outcome with its cluster contrast, variance components and ICC."""
    lines = ["| a | b | difference (a - b) | estimate | 95% CI (t over warm starts) | p | warm starts | runs "
             "| σ² between | σ² within | ICC |", "|---" * 11 + "|"]
    words = []
    names = {"auc": "expected-acc AUC", "late": "expected acc, last 30 updates"}
    for pair in pairs:
        for key, row in (pair.get("clusters") or {}).items():
            name = pair["outcome"] if key == "outcome" else names.get(key, key)
            lines.append(f"| {pair['a']} | {pair['b']} | {name} | {_num(row['diff'], '+.3g')} "
                         f"| [{_num(row['lo'])}, {_num(row['hi'])}] | {_num(row['p'])} | {row['warm_starts']} "
                         f"| {row['runs']} | {_num(row['var_between'])} | {_num(row['var_within'])} "
                         f"| {_num(row['icc'], '.2f')} |")
            words.append(f"- **{pair['a']}** vs **{pair['b']}**, {name}, over warm starts: "
                         f"{_num(row['diff'], '+.3g')} [{_num(row['lo'])}, {_num(row['hi'])}]: {row['verdict']}.")
    for pair in pairs:
        reg = pair.get("regression_by_warm_start")
        if reg:
            words.append(format_regression_by_warm_start(pair["a"], pair["b"], reg))
        ends = pair.get("ends_by_warm_start")
        if ends:
            words.append(format_ends_by_warm_start(pair["a"], pair["b"], ends))
    note = ("Per warm start, the mean over its RL seeds of the paired difference; the CI is a Student t over "
            "warm starts. σ² between / within: one-way random-effects ANOVA (method of moments, between "
            "truncated at 0) on the paired differences; ICC = between / (between + within). A verdict needs "
            f"at least {MIN_WARM_STARTS} warm starts. Sustained regression by warm start: each arm's regressed "
            "runs over those with a pre-update eval, per warm start; p of the exact conditional (Mantel–Haenszel) "
            "test that both arms regress at one rate within every warm start, and of the log-rank test of time "
            "to regression stratified by warm start. Ends regressed by warm start: runs whose mean expected "
            "accuracy over their last 30 updates is below 0.8 x the pre-update value (a sustained regression "
            "the run recovers from does not count), by the same exact conditional test.")
    return "\n\n".join(["\n".join(lines), note, "\n".join(words)])


def format_ends_by_warm_start(a: str, b: str, ends: dict[str, Any]) -> str:
    """One sentence: each arm's runs that end regressed, per warm start, and the exact stratified test's p."""
    return _counts_by_warm_start(a, b, ends, "ended", "ends regressed", "")


def format_regression_by_warm_start(a: str, b: str, reg: dict[str, Any]) -> str:
    """One sentence: each arm's sustained regressions, per warm start, and the two stratified tests' p."""
    logrank = f", {reg['logrank_test']} χ² = {_num(reg['logrank_chi2'])}, p = {_num(reg['logrank_p'])}"
    return _counts_by_warm_start(a, b, reg, "regressed", "sustained regression", logrank)


def _counts_by_warm_start(a: str, b: str, row: dict[str, Any], count: str, what: str, more: str) -> str:
    """The sentence of a stratified count row (stratified_ends_test's or stratified_regression_test's, whose
    counts are `count`_a and `count`_b): totals, per warm start, the exact test's p, then `more`, the verdict."""
    per = ", ".join(f"{w[count + '_a']}/{w['n_a']} vs {w[count + '_b']}/{w['n_b']}" for w in row["per_warm_start"])
    judged = warm_start_verdict(Difference(math.nan, math.nan, math.nan, row["exact_p"], row["warm_starts"],
                                           row["warm_starts"], row["exact_test"]))
    return (f"- **{a}** vs **{b}**, {what} by warm start: {row[count + '_a']}/{row['n_a']} vs "
            f"{row[count + '_b']}/{row['n_b']} ({per}); {row['exact_test']} p = {_num(row['exact_p'])}{more}: {judged}.")
