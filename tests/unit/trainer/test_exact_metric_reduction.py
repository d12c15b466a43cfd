"""moe_rl.reduction: metrics kept as sums, counts and extremes reduce exactly, whatever their name."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from moe_rl import reduction as S
from moe_rl.objectives import OBJECTIVES


def test_combined_parts_equal_the_pooled_statistic():
    """Stats of three uneven chunks, combined, equal the stats of all entries at once, for every kind."""
    x = torch.randn(23, generator=torch.Generator().manual_seed(0), dtype=torch.float64).exp()
    makers = {"mean": S.mean, "sum": S.total, "max": S.maximum, "min": S.minimum, "var": S.variance,
              "ess": S.ess, "chi2": S.chi2}
    chunks = [x[:2], x[2:17], x[17:], x[:0]]  # the empty chunk contributes nothing (max/min NaN skipped)
    for kind, make in makers.items():
        pooled = S.values({"k": make(x)})["k"]
        combined = S.value(S.combine([S.to_floats({"k": make(c)}) for c in chunks])["k"])
        assert combined == pytest.approx(pooled, rel=1e-13), kind
    xs = x.tolist()
    assert S.values({"v": S.variance(x)})["v"] == pytest.approx(statistics.pvariance(xs), rel=1e-13)
    assert S.values({"e": S.ess(x)})["e"] == pytest.approx(sum(xs) ** 2 / (len(xs) * sum(v * v for v in xs)))
    assert S.values({"c": S.chi2(x)})["c"] == pytest.approx(statistics.fmean(v * v for v in xs) - 1)
    assert math.isnan(S.values({"m": S.mean(x[:0])})["m"])


def test_share_pools_its_parts_and_is_nan_without_a_total():
    """A `share` stat, combined over uneven chunks, is Σ part / Σ whole of all entries (float64), NaN when
    the whole is 0."""
    w = torch.randn(23, generator=torch.Generator().manual_seed(1), dtype=torch.float64).abs()
    part = torch.where(w > 1.0, w, 0.0)
    chunks = [slice(0, 2), slice(2, 17), slice(17, None), slice(0, 0)]
    combined = S.value(S.combine([S.to_floats({"s": S.share(part[c], w[c])}) for c in chunks])["s"])
    assert combined == pytest.approx(sum(v for v in w.tolist() if v > 1.0) / sum(w.tolist()), rel=1e-13)
    assert math.isnan(S.values({"s": S.share(w[:0], w[:0])})["s"])
    assert math.isnan(S.value(S.Stat("share", (0.0, 0.0))))


def test_over_updates_adds_totals_and_averages_the_rest():
    """Over a step's mini-batches a `sum` and a `share` add their parts (a share is not a mean of shares);
    every other kind is the NaN-skipping mean of the updates' values, bitwise Python's sum over them; the
    extremes are the max and min over all updates, skipping a NaN (an update without entries)."""
    per_update = [
        {"a": S.Stat("sum", (0.1,)), "b": S.Stat("share", (1.0, 4.0)), "c": S.Stat("mean", (0.3, 3.0)),
         "d": S.Stat("max", (2.0,)), "e": S.Stat("min", (math.nan,))},
        {"a": S.Stat("sum", (0.2,)), "b": S.Stat("share", (0.0, 1.0)), "c": S.Stat("mean", (0.0, 0.0)),
         "d": S.Stat("max", (5.0,)), "e": S.Stat("min", (-1.0,))},
        {"a": S.Stat("sum", (-0.0,)), "b": S.Stat("share", (3.0, 5.0)), "c": S.Stat("mean", (0.7, 3.0)),
         "d": S.Stat("max", (1.0,)), "e": S.Stat("min", (0.5,))},
    ]
    got = S.values(S.over_updates(per_update))
    assert got["a"] == 0.1 + 0.2 + -0.0
    assert got["b"] == 4.0 / 10.0
    assert got["c"] == (0.3 / 3.0 + 0.7 / 3.0) / 2
    assert got["d"] == (2.0 + 5.0 + 1.0) / 3
    assert got["e"] == (-1.0 + 0.5) / 2
    assert S.values(S.extremes(per_update)) == {"d": 5.0, "e": -1.0}
    only_negative_zero = S.values(S.over_updates([{"a": S.Stat("sum", (-0.0,))}]))["a"]
    assert math.copysign(1.0, only_negative_zero) == 1.0  # as sum([-0.0]) == 0.0, not -0.0


@pytest.mark.parametrize("name", sorted(n for n in OBJECTIVES if not n.startswith("dppo_topk")))
def test_objective_stats_over_split_rows_equal_one_call_on_all_rows(name):
    """Every metric an objective returns, computed on two halves of a batch and combined with no name list,
    equals the metric of one call on the whole batch (means over tokens, variances, extremes and sums)."""
    g = torch.Generator().manual_seed(5)
    B, T = 10, 7
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    old = -2 * torch.rand(B, T, generator=g, dtype=torch.float64)
    logp = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    fn = OBJECTIVES[name]
    clip = {"clip_low": 0.1, "clip_high": 0.15}

    def stats(rows):
        return fn.compute(fn.inputs(logp[rows], old[rows], adv[rows], mask[rows], **clip))[1]

    whole = S.values(stats(slice(None)))
    # per-sequence means (clip/seq_frac, ratio/seq/*) pool over sequences, per-token ones over tokens
    split = {k: S.value(v) for k, v in S.combine([S.to_floats(stats(slice(0, 3))),
                                                   S.to_floats(stats(slice(3, None)))]).items()}
    assert set(split) == set(whole)
    for key, value in whole.items():
        assert split[key] == pytest.approx(value, rel=1e-12, nan_ok=True), key
