"""Statistics over seeds: confidence intervals, two-group tests and smoothing, as small pure functions.

Every number a table or figure aggregates over seeds goes through these, so one place says how:

| quantity | method |
|---|---|
| mean over seeds | `mean_ci`: Student t interval, mean ± t_{n-1, 0.975} · s / sqrt(n), s the sample sd (ddof 1) |
| difference of two group means | `welch`: Welch's t (unequal variances), Welch–Satterthwaite dof, two-sided p |
| paired difference (same seeds in both groups) | `paired_t`: t interval of the per-seed differences, n - 1 dof, two-sided p |
| slope of one seed's runs | `ols_slope`: least-squares slope with its t interval (n - 2 dof) and two-sided p of slope = 0 |
| dose trend over seeds | `slope_over_seeds`: one least-squares slope per seed, then `one_sample_t` over the seeds' slopes (n_seeds - 1 dof), so runs sharing a seed are not counted as independent |
| time to an event (censored) | `logrank`: two-sample log-rank (Mantel–Cox) chi-square, 1 dof; `stratified_logrank`: the same summed over strata (warm starts) |
| event rates across strata | `exact_stratified`: the exact conditional (Mantel–Haenszel) test of no association in stratified 2x2 tables, two-sided |
| difference of two rates | `rate_difference`: Newcombe's hybrid Wilson score interval (1998, method 10) and a two-sided permutation test of the difference |
| several tests at once | `holm`: Holm's step-down adjusted p-values, controlling the family-wise error rate |
| smoothed curve | `ema`: s_0 = x_0, s_t = w · s_{t-1} + (1 - w) · x_t (w = 0: no smoothing) |

Non-finite values are dropped before any statistic: a seed whose value is NaN does not count in n.
With n < 2 a mean has no interval (half-width nan); a test with fewer than two values per group gives
nan. `verdict` turns a p-value into the sentence the report prints, and refuses a verdict below
MIN_SEEDS seeds per group: with 2-4 seeds a t-test has almost no power and its p-value rests
entirely on the normality assumption.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

LEVEL = 0.95
MIN_SEEDS = 5
CI_NOTE = "mean ± 95% CI half-width over seeds (Student t, n - 1 dof); n = seeds with a finite value"


def finite(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """The finite entries of `values` as float64."""
    v = np.asarray(values, dtype=np.float64).ravel()
    return v[np.isfinite(v)]


def finite_mean(values) -> float:
    """Mean of the finite values (nan when there are none)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else math.nan


@dataclass(frozen=True)
class MeanCI:
    """A mean over seeds with its confidence interval: mean ± half (nan half when n < 2)."""

    mean: float
    half: float
    n: int

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half

    def format(self, digits: int = 4) -> str:
        """The cell text: "0.5123 ± 0.0412", "0.5123 ± –" with one seed, "n/a" with none."""
        if self.n == 0:
            return "n/a"
        half = "–" if not math.isfinite(self.half) else f"{self.half:.2g}"
        return f"{self.mean:.{digits}g} ± {half}"


def mean_ci(values: Sequence[float] | np.ndarray, level: float = LEVEL) -> MeanCI:
    """Mean of the finite values with the Student t interval  mean ± t_{n-1,(1+level)/2} · s / sqrt(n)."""
    v = finite(values)
    if v.size == 0:
        return MeanCI(math.nan, math.nan, 0)
    if v.size == 1:
        return MeanCI(float(v[0]), math.nan, 1)
    sem = v.std(ddof=1) / math.sqrt(v.size)
    return MeanCI(float(v.mean()), float(sps.t.ppf((1 + level) / 2, v.size - 1) * sem), int(v.size))


@dataclass(frozen=True)
class Difference:
    """A difference a - b between two groups, its interval [lo, hi], the test's p-value and the test's name."""

    diff: float
    lo: float
    hi: float
    p: float
    n_a: int
    n_b: int
    test: str


def welch(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Difference:
    """Welch's t for mean(a) - mean(b): se = sqrt(s_a²/n_a + s_b²/n_b), t = diff / se,
    dof = se⁴ / ((s_a²/n_a)²/(n_a-1) + (s_b²/n_b)²/(n_b-1)), CI diff ± t_{dof,(1+level)/2} · se,
    p = 2 · P(T_dof > |t|). nan p and interval when a group has < 2 values or both have zero variance."""
    va, vb = finite(a), finite(b)
    na, nb = int(va.size), int(vb.size)
    if na < 2 or nb < 2:
        diff = float(va.mean() - vb.mean()) if na and nb else math.nan
        return Difference(diff, math.nan, math.nan, math.nan, na, nb, "Welch t-test")
    diff = float(va.mean() - vb.mean())
    # Tested by value: the float variance of equal values such as 0.2 can be 1e-33 rather than 0.
    if np.ptp(va) == 0 and np.ptp(vb) == 0:
        return Difference(diff, math.nan, math.nan, math.nan, na, nb, "Welch t-test")
    qa, qb = va.var(ddof=1) / na, vb.var(ddof=1) / nb
    se = math.sqrt(qa + qb)
    dof = (qa + qb) ** 2 / (qa**2 / (na - 1) + qb**2 / (nb - 1))
    half = float(sps.t.ppf((1 + level) / 2, dof) * se)
    p = float(2 * sps.t.sf(abs(diff) / se, dof))
    return Difference(diff, diff - half, diff + half, p, na, nb, "Welch t-test")


def paired_t(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Difference:
    """Paired t for mean(a_i - b_i) over pairs where both are finite (a and b aligned, e.g. by seed, so a
    seed's shared warm start and eval set cancel): CI mean ± t_{n-1,(1+level)/2} · s_d / sqrt(n),
    p = 2 · P(T_{n-1} > |mean / (s_d / sqrt(n))|). nan p and interval with < 2 pairs or zero spread."""
    va, vb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if va.shape != vb.shape:
        raise ValueError(f"paired_t needs aligned samples, got {va.size} and {vb.size} values")
    d = (va - vb)[np.isfinite(va) & np.isfinite(vb)]
    n = int(d.size)
    mean = float(d.mean()) if n else math.nan
    if n < 2 or np.ptp(d) == 0:
        return Difference(mean, math.nan, math.nan, math.nan, n, n, "paired t-test")
    se = float(d.std(ddof=1) / math.sqrt(n))
    half = float(sps.t.ppf((1 + level) / 2, n - 1) * se)
    p = float(2 * sps.t.sf(abs(mean) / se, n - 1))
    return Difference(mean, mean - half, mean + half, p, n, n, "paired t-test")


def ols_slope(x: Sequence[float], y: Sequence[float], level: float = LEVEL) -> Difference:
    """Least-squares slope of y on x over the finite pairs, with its t interval (n - 2 dof) and the
    two-sided p-value of slope = 0; returned as a Difference (diff = slope, n_a = n_b = n)."""
    vx, vy = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    keep = np.isfinite(vx) & np.isfinite(vy)
    vx, vy = vx[keep], vy[keep]
    n = int(vx.size)
    if n < 3 or np.ptp(vx) == 0:
        return Difference(math.nan, math.nan, math.nan, math.nan, n, n, "OLS slope t-test")
    fit = sps.linregress(vx, vy)
    half = float(sps.t.ppf((1 + level) / 2, n - 2) * fit.stderr)
    return Difference(float(fit.slope), float(fit.slope) - half, float(fit.slope) + half, float(fit.pvalue), n, n,
                      "OLS slope t-test")


def wilson(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials."""
    z = float(sps.norm.ppf((1 + level) / 2))
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def permutation_p(
    a: Sequence[float], b: Sequence[float], permutations: int = 10_000, seed: int = 0
) -> tuple[float, str]:
    """Two-sided permutation p-value of |mean(a) - mean(b)| over relabellings of the pooled values.

    Exact (every one of C(n_a + n_b, n_a) splits, p = share with |diff| >= observed) when there are at
    most `permutations` splits; otherwise `permutations` random splits from numpy's generator seeded
    with `seed`, p = (1 + count) / (1 + permutations) (Phipson & Smyth 2010, never 0).
    Returns (p, "exact" or "N random splits"). Suffix S: one entry per split.
    """
    va, vb = finite(a), finite(b)
    pooled, na = np.concatenate([va, vb]), va.size
    observed = abs(va.mean() - vb.mean())
    tol = 1e-12 * max(1.0, observed)  # ties in floating point count as extreme
    total = math.comb(pooled.size, na)
    if total <= permutations:
        in_a_SK = np.array(list(itertools.combinations(range(pooled.size), na)), dtype=np.intp)
        sum_a_S = pooled[in_a_SK].sum(axis=1)
        kind = "exact"
    else:
        rng = np.random.default_rng(seed)
        sum_a_S = rng.permuted(np.tile(pooled, (permutations, 1)), axis=1)[:, :na].sum(axis=1)
        kind = f"{permutations} random splits"
    diff_S = sum_a_S / na - (pooled.sum() - sum_a_S) / vb.size
    count = int((np.abs(diff_S) >= observed - tol).sum())
    if kind == "exact":
        return float(count / total), kind
    return float((1 + count) / (1 + permutations)), kind


def rate_difference(
    a: Sequence[bool], b: Sequence[bool], permutations: int = 10_000, seed: int = 0, level: float = LEVEL
) -> Difference:
    """rate(a) - rate(b) for two groups of 0/1 outcomes (a seed collapsed or not).

    Interval: Newcombe's hybrid score interval from the groups' Wilson intervals [l_a, u_a], [l_b, u_b]:
    [d - sqrt((p_a - l_a)² + (u_b - p_b)²), d + sqrt((u_a - p_a)² + (p_b - l_b)²)], d = p_a - p_b.
    p-value: `permutation_p` on the 0/1 outcomes.
    """
    va, vb = finite(np.asarray(a, dtype=float)), finite(np.asarray(b, dtype=float))
    na, nb = int(va.size), int(vb.size)
    if na == 0 or nb == 0:
        return Difference(math.nan, math.nan, math.nan, math.nan, na, nb, "permutation test")
    pa, pb = float(va.mean()), float(vb.mean())
    (la, ua), (lb, ub) = wilson(int(va.sum()), na, level), wilson(int(vb.sum()), nb, level)
    d = pa - pb
    lo = d - math.sqrt((pa - la) ** 2 + (ub - pb) ** 2)
    hi = d + math.sqrt((ua - pa) ** 2 + (pb - lb) ** 2)
    p, kind = permutation_p(va, vb, permutations, seed)
    return Difference(d, lo, hi, p, na, nb, f"permutation test, {kind}")


def verdict(d: Difference, alpha: float = 0.05, min_seeds: int = MIN_SEEDS) -> str:
    """The report's sentence on whether difference `d` is distinguishable from noise at level alpha."""
    if min(d.n_a, d.n_b) < min_seeds:
        return (
            f"no verdict possible: {min(d.n_a, d.n_b)} seed(s) in the smaller group (< {min_seeds}); "
            "run more seeds"
        )
    if not math.isfinite(d.p):
        return "no verdict possible: no variation within the groups to test against"
    pct = f"{100 * alpha:g}%"
    if d.p < alpha:
        return f"distinguishable from noise at {pct} ({d.test}, p = {d.p:.3g})"
    return f"not distinguishable from noise at {pct} ({d.test}, p = {d.p:.3g})"


def short_verdict(sentence: str) -> str:
    """A `verdict` without its parenthesis (for a table that shows the CI and p beside it)."""
    return sentence.split(" (", 1)[0]


def format_difference(d: Difference) -> str:
    """A difference as a table cell: "+0.012 [-0.003, +0.027], p = 0.11" (interval and p where finite)."""
    if not math.isfinite(d.diff):
        return "n/a"
    ci = f" [{d.lo:+.3f}, {d.hi:+.3f}]" if math.isfinite(d.lo) else ""
    p = f", p = {d.p:.2g}" if math.isfinite(d.p) else ""
    return f"{d.diff:+.3f}{ci}{p}"


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's (1979) step-down adjusted p-values, in the input order: with the m finite p sorted ascending,
    p_(1) <= ... <= p_(m), adj_(i) = min(1, max_{j <= i} (m - j + 1) p_(j)). A family is rejected at level α
    wherever adj < α, with family-wise error at most α under any dependence. Non-finite p stay nan and do
    not count in m."""
    p = np.asarray(pvalues, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    order = idx[np.argsort(p[idx], kind="stable")]
    m = order.size
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(p[i])))
        out[i] = running
    return [float(x) for x in out]


def ema(values: Sequence[float] | np.ndarray, weight: float) -> np.ndarray:
    """Exponential moving average s_t = w · s_{t-1} + (1 - w) · x_t, s_0 = the first finite x.

    Non-finite x_t leave s_t = nan and do not update the state, so a missing step is skipped, not
    treated as 0. weight = 0 returns the values unchanged (as float64).
    """
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    x = np.asarray(values, dtype=np.float64)
    out = np.full(x.shape, np.nan)
    state = math.nan
    for i, v in enumerate(x):
        if not math.isfinite(v):
            continue
        state = v if math.isnan(state) else weight * state + (1 - weight) * v
        out[i] = state
    return out


def one_sample_t(values: Sequence[float], level: float = LEVEL) -> Difference:
    """Student t for mean(values) = 0 over the finite values: `paired_t` against zeros (n - 1 dof)."""
    v = np.asarray(values, dtype=np.float64)
    d = paired_t(v, np.zeros_like(v), level)
    return dataclasses.replace(d, test="one-sample t-test")


def slope_over_seeds(
    x_by_seed: dict[int, Sequence[float]], y_by_seed: dict[int, Sequence[float]], level: float = LEVEL
) -> tuple[Difference, dict[int, float]]:
    """One least-squares slope of y on x per seed (over that seed's finite pairs; nan with fewer than two
    distinct x), then `one_sample_t` over the finite slopes: (its Difference, n_a = n_b = seeds with a
    slope, test "one-sample t-test over per-seed slopes"; the slope of every seed)."""
    slopes = {}
    for seed in sorted(x_by_seed):
        vx, vy = np.asarray(x_by_seed[seed], dtype=np.float64), np.asarray(y_by_seed[seed], dtype=np.float64)
        keep = np.isfinite(vx) & np.isfinite(vy)
        vx, vy = vx[keep], vy[keep]
        slopes[seed] = (
            float(np.sum((vx - vx.mean()) * (vy - vy.mean())) / np.sum((vx - vx.mean()) ** 2))
            if vx.size >= 2 and np.ptp(vx) > 0 else math.nan
        )  # fmt: skip
    d = one_sample_t(list(slopes.values()), level)
    return dataclasses.replace(d, test="one-sample t-test over per-seed slopes"), slopes


@dataclass(frozen=True)
class LogRank:
    """A two-sample log-rank test: chi-square (1 dof), p, observed and expected events per group, group sizes."""

    chi2: float
    p: float
    observed_a: int
    expected_a: float
    observed_b: int
    expected_b: float
    n_a: int
    n_b: int
    test: str = "log-rank test"


def _logrank_terms(
    time_a: Sequence[float], event_a: Sequence[bool], time_b: Sequence[float], event_b: Sequence[bool]
) -> tuple[int, float, int, float, float, int, int]:
    """One stratum's (O_a, E_a, O_b, E_b, V, n_a, n_b) of the log-rank test (`logrank`'s docstring)."""
    ta, ea = np.asarray(time_a, dtype=np.float64), np.asarray(event_a, dtype=bool)
    tb, eb = np.asarray(time_b, dtype=np.float64), np.asarray(event_b, dtype=bool)
    ka, kb = np.isfinite(ta), np.isfinite(tb)
    ta, ea, tb, eb = ta[ka], ea[ka], tb[kb], eb[kb]
    time_U, event_U = np.concatenate([ta, tb]), np.concatenate([ea, eb])
    in_a_U = np.arange(time_U.size) < ta.size
    t_J = np.unique(time_U[event_U])
    at_risk_J = (time_U[None, :] >= t_J[:, None]).sum(1)
    at_risk_a_J = ((time_U[None, :] >= t_J[:, None]) & in_a_U[None, :]).sum(1)
    hit_JU = (time_U[None, :] == t_J[:, None]) & event_U[None, :]
    d_J, d_a_J = hit_JU.sum(1), (hit_JU & in_a_U[None, :]).sum(1)
    share_J = at_risk_a_J / at_risk_J
    expected_a = float(np.sum(d_J * share_J))
    ties_J = np.where(at_risk_J > 1, (at_risk_J - d_J) / np.maximum(at_risk_J - 1, 1), 1.0)
    var = float(np.sum(d_J * share_J * (1 - share_J) * ties_J))
    observed_a, observed_b = int(d_a_J.sum()), int(d_J.sum() - d_a_J.sum())
    return observed_a, expected_a, observed_b, float(d_J.sum()) - expected_a, var, int(ta.size), int(tb.size)


def _logrank_from(terms: list[tuple[int, float, int, float, float, int, int]], test: str) -> LogRank:
    o_a, e_a, o_b, e_b, var, n_a, n_b = (sum(x) for x in zip(*terms, strict=True))
    if var <= 0:
        return LogRank(math.nan, math.nan, o_a, e_a, o_b, e_b, n_a, n_b, test)
    chi2 = (o_a - e_a) ** 2 / var
    return LogRank(chi2, math.erfc(math.sqrt(chi2 / 2)), o_a, e_a, o_b, e_b, n_a, n_b, test)


def logrank(
    time_a: Sequence[float], event_a: Sequence[bool], time_b: Sequence[float], event_b: Sequence[bool]
) -> LogRank:
    """Two-sample log-rank (Mantel–Cox) test that groups a and b share one hazard of the event.

    Each unit has a time and whether the event happened then (True) or it was censored there (False:
    known to be event-free up to that time). At each distinct event time t_j, with n_j units at risk
    (time >= t_j; a unit censored at t_j is still at risk there), n_aj of them in a, and d_j events,
    d_aj in a: E_a = Σ_j d_j n_aj / n_j, V = Σ_j d_j (n_aj / n_j)(1 - n_aj / n_j)(n_j - d_j) / (n_j - 1)
    (hypergeometric variance; the factor is 1 where n_j = 1), chi2 = (O_a - E_a)² / V and
    p = P(χ²_1 > chi2) = erfc(sqrt(chi2 / 2)). nan chi2 and p when V = 0 (no event, or no unit of one
    group at risk at any event). Non-finite times are dropped. Suffix U: one entry per unit, J: per event time.
    """
    return _logrank_from([_logrank_terms(time_a, event_a, time_b, event_b)], "log-rank test")


def stratified_logrank(
    strata: Sequence[tuple[Sequence[float], Sequence[bool], Sequence[float], Sequence[bool]]],
) -> LogRank:
    """The log-rank test stratified by, e.g., warm start: each stratum h's (time_a, event_a, time_b, event_b)
    gives its own O_a,h, E_a,h and V_h at its own risk sets (`logrank`), and
    chi2 = (Σ_h (O_a,h - E_a,h))² / Σ_h V_h, 1 dof. Units are compared only with units of their stratum, so
    a warm start that regresses more under both arms does not count as evidence for either."""
    if not strata:
        return LogRank(math.nan, math.nan, 0, 0.0, 0, 0.0, 0, 0, "stratified log-rank test")
    return _logrank_from([_logrank_terms(*s) for s in strata], "stratified log-rank test")


@dataclass(frozen=True)
class ExactStratified:
    """The exact conditional test of no association in K stratified 2x2 tables (events a / b per stratum)."""

    p: float
    observed_a: int
    expected_a: float
    events_a: tuple[int, ...]
    n_a: tuple[int, ...]
    events_b: tuple[int, ...]
    n_b: tuple[int, ...]
    test: str = "exact stratified (conditional) test"


def exact_stratified(events_a: Sequence[int], n_a: Sequence[int], events_b: Sequence[int],
                     n_b: Sequence[int]) -> ExactStratified:
    """Exact test that arms a and b have one event rate within every stratum (the exact Mantel–Haenszel
    test of a common odds ratio of 1; R's `mantelhaen.test(exact = TRUE)`, two-sided).

    Stratum h has n_a,h units of a with x_h events and n_b,h of b, m_h events in all. Given every
    stratum's margins, under H0 x_h ~ Hypergeometric(n_a,h + n_b,h, m_h, n_a,h) independently, so
    S = Σ_h x_h has the convolution of those pmfs. Two-sided p = Σ P(S = s) over the s with
    P(S = s) <= P(S = s_obs) (1 + 1e-7), the rule of Fisher's exact test, which this is for one stratum.
    A stratum without events (or without units of one arm) carries no information and drops out;
    p = 1 when none is left. Strata are in the order given.
    """
    xa, na_, xb, nb_ = (tuple(int(v) for v in seq) for seq in (events_a, n_a, events_b, n_b))
    if not len(xa) == len(na_) == len(xb) == len(nb_):
        raise ValueError("exact_stratified: one count per stratum in each of the four sequences")
    pmf = np.ones(1)
    low = 0
    for x, na, y, nb in zip(xa, na_, xb, nb_, strict=True):
        if not (0 <= x <= na and 0 <= y <= nb):
            raise ValueError(f"exact_stratified: events outside 0..n in a stratum ({x}/{na}, {y}/{nb})")
        m = x + y
        lo, hi = max(0, m - nb), min(na, m)
        stratum = sps.hypergeom.pmf(np.arange(lo, hi + 1), na + nb, m, na)
        pmf, low = np.convolve(pmf, stratum), low + lo
    observed = sum(xa)
    expected = float(np.dot(np.arange(low, low + pmf.size), pmf))
    p_obs = pmf[observed - low]
    p = float(min(1.0, pmf[pmf <= p_obs * (1 + 1e-7)].sum()))
    return ExactStratified(p, observed, expected, xa, na_, xb, nb_)
