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
