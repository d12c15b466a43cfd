"""Metric statistics that reduce exactly: each metric is a few float64 numbers and the rule that makes
them one value, so combining them over ranks or mini-batches needs no list of metric names.

A `Stat` holds its reduction *kind* next to its numbers; `combine` adds what adds and takes the max of
what is a max, whatever the key; `value` finishes it. A new metric is therefore reduced correctly the
moment it is returned, without being registered anywhere.

| kind | parts | combine | value |
|---|---|---|---|
| `mean` | (Σx, n) | add | Σx / n (NaN when n = 0) |
| `sum` | (Σx,) | add | Σx |
| `max`, `min` | (x,) | max / min, skipping NaN (a part with no entry) | x |
| `var` | (n, mean, M2), M2 = Σ(x − mean)² | Chan et al.'s pairwise update | M2 / n, the population variance |
| `ess` | (n, Σw, Σw²) | add | (Σw)² / (n Σw²), the normalised effective sample size |
| `chi2` | (n, Σw²) | add | Σw² / n − 1 (the χ² divergence of weights whose mean is 1) |
| `share` | (num, den) | add | num / den (NaN when den ≤ 0): a part of a non-negative total |

Over a step's mini-batches (`over_updates`) the kind decides too: a `sum` or a `share` totals the step, so
its parts add over the updates as over ranks; every other kind describes one update, and the step's value
is the mean of the updates' finished values (NaN-skipping), with their extremes kept beside it
(`extremes`).

Every part is float64, so counts stay exact; one combine of two single-rank stats gives exactly (up to
float64 rounding) the statistic of the pooled entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

KINDS = ("mean", "sum", "max", "min", "var", "ess", "chi2", "share")
STEP_TOTALS = ("sum", "share")
"""The kinds whose parts add over a step's mini-batches (`over_updates`)."""


@dataclass(frozen=True)
class Stat:
    """One metric's sufficient statistics: `parts` (a tuple of floats, or 0-d tensors before `to_floats`)."""

    kind: str
    parts: tuple


Stats = dict[str, Stat]


@torch.no_grad()
def mean(x_N: Tensor) -> Stat:
    """The mean of the entries of x (any shape, all of them valid)."""
    x_N = x_N.double()
    return Stat("mean", (x_N.sum(), x_N.new_tensor(float(x_N.numel()))))


@torch.no_grad()
def ratio(num: Tensor, den: Tensor) -> Stat:
    """num / den where both add over ranks and mini-batches (a weighted mean)."""
    return Stat("mean", (num.double(), den.double()))


def weighted(x: float, weight: float) -> Stat:
    """A value that is already a mean over `weight` entries (a rank's), pooled weighted by them; NaN (no
    entries to average) counts for nothing."""
    return Stat("mean", (0.0, 0.0) if math.isnan(x) else (x * weight, weight))


def scalar(x: float) -> Stat:
    """One number per rank (a loss, a gradient norm), averaged over ranks and mini-batches alike."""
    return Stat("mean", (float(x), 1.0))


@torch.no_grad()
def total(x: Tensor) -> Stat:
    """Σ x."""
    return Stat("sum", (x.double().sum(),))


@torch.no_grad()
def maximum(x_N: Tensor) -> Stat:
    """max x over its entries; NaN when there are none."""
    x_N = x_N.double()
    return Stat("max", (x_N.max() if x_N.numel() else x_N.new_tensor(math.nan),))


@torch.no_grad()
def minimum(x_N: Tensor) -> Stat:
    """min x over its entries; NaN when there are none."""
    x_N = x_N.double()
    return Stat("min", (x_N.min() if x_N.numel() else x_N.new_tensor(math.nan),))


@torch.no_grad()
def variance(x_N: Tensor) -> Stat:
    """Population variance 1/n Σ (x − mean x)², kept as (n, mean, M2) so it pools exactly."""
    x_N = x_N.double()
    mu = x_N.mean()
    return Stat("var", (x_N.new_tensor(float(x_N.numel())), mu, (x_N - mu).square().sum()))


@torch.no_grad()
def ess(w_N: Tensor) -> Stat:
    """Normalised effective sample size (Σ w)² / (n Σ w²) of importance weights w (Kish)."""
    w_N = w_N.double()
    return Stat("ess", (w_N.new_tensor(float(w_N.numel())), w_N.sum(), w_N.square().sum()))


@torch.no_grad()
def chi2(w_N: Tensor) -> Stat:
    """χ² divergence estimate mean(w²) − 1 of importance weights w (verl's rollout_corr χ²)."""
    w_N = w_N.double()
    return Stat("chi2", (w_N.new_tensor(float(w_N.numel())), w_N.square().sum()))


@torch.no_grad()
def share(part: Tensor, whole: Tensor) -> Stat:
    """Σ part / Σ whole of a non-negative total (its share in `part`), pooled over ranks and a step's
    mini-batches alike; NaN when nothing is left of the total."""
    return Stat("share", (part.double().sum(), whole.double().sum()))


def to_floats(stats: Stats) -> Stats:
    """The same stats with Python-float parts, with one device sync (picklable, for a gather)."""
    flat = [p for s in stats.values() for p in s.parts]
    if not flat:
        return {}
    values = torch.stack([torch.as_tensor(p, dtype=torch.float64).cpu() for p in flat]).tolist()
    out, i = {}, 0
    for key, s in stats.items():
        out[key] = Stat(s.kind, tuple(values[i : i + len(s.parts)]))
        i += len(s.parts)
    return out


def _pair(a: Stat, b: Stat) -> Stat:
    assert a.kind == b.kind, (a.kind, b.kind)
    if a.kind in ("max", "min"):
        finite = [p[0] for p in (a.parts, b.parts) if not math.isnan(p[0])]
        return Stat(a.kind, ((max if a.kind == "max" else min)(finite) if finite else math.nan,))
    if a.kind == "var":
        (na, ma, qa), (nb, mb, qb) = a.parts, b.parts
        if na == 0 or nb == 0:
            return a if nb == 0 else b
        n = na + nb
        delta = mb - ma
        return Stat("var", (n, ma + delta * nb / n, qa + qb + delta * delta * na * nb / n))
    return Stat(a.kind, tuple(x + y for x, y in zip(a.parts, b.parts, strict=True)))


def combine(many: list[Stats]) -> Stats:
    """The stats of all entries of `many` (each from to_floats: ranks, or mini-batches), key by key."""
    out = dict(many[0])
    for stats in many[1:]:
        for key, s in stats.items():
            out[key] = _pair(out[key], s) if key in out else s
    return out


def value(s: Stat) -> float:
    """A finished metric from its (float) parts; NaN where its denominator is empty, never a placeholder 0."""
    p = s.parts
    if s.kind in ("sum", "max", "min"):
        return float(p[0])
    if s.kind == "mean":
        return p[0] / p[1] if p[1] else math.nan
    if s.kind == "var":
        return p[2] / p[0] if p[0] else math.nan
    if s.kind == "ess":
        return p[1] ** 2 / (p[0] * p[2]) if p[0] and p[2] else math.nan
    if s.kind == "chi2":
        return p[1] / p[0] - 1.0 if p[0] else math.nan
    if s.kind == "share":
        return p[0] / p[1] if p[1] > 0 else math.nan
    raise ValueError(f"unknown stat kind {s.kind!r}; expected one of {KINDS}")


def values(stats: Stats) -> dict[str, float]:
    """Every stat finished to a float (one device sync for the lot)."""
    return {key: value(s) for key, s in to_floats(stats).items()}


def _zero(s: Stat) -> Stat:
    """The stat of no entries: adding it changes nothing (not even a −0.0, as Python's `sum` starts at 0)."""
    return Stat(s.kind, (0.0,) * len(s.parts))


def over_updates(per_update: list[Stats]) -> Stats:
    """A step's stats from its mini-batches' (each already combined over ranks, float parts): a `sum` or
    a `share` adds its parts over them; any other kind becomes the `mean` of the updates' finished
    values, an update whose value is NaN (no entries) counting for nothing."""
    lifted = [
        {key: s if s.kind in STEP_TOTALS else weighted(value(s), 1.0) for key, s in stats.items()}
        for stats in per_update
    ]
    return combine([{key: _zero(s) for key, s in lifted[0].items()}, *lifted])


def extremes(per_update: list[Stats]) -> Stats:
    """The `max` and `min` stats over all of a step's mini-batches (each combined over ranks): the
    extreme of any update, not their mean (what the collapse detector reads)."""
    return combine([{key: s for key, s in stats.items() if s.kind in ("max", "min")} for stats in per_update])
