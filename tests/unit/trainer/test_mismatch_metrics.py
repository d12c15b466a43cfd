"""The trainer-sampler health metrics (issue 53; moe_rl.trainer.step_metrics.mismatch_metrics) against
their references restated per token, and their exact reduction over split rows."""

import math

import pytest
import torch

from moe_rl import reduction as S
from moe_rl.trainer.step_metrics import mismatch_metrics


def batch(seed=0, B=6, R=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, R, generator=g) < 0.7
    mask[0] = False
    trainer = -3 * torch.rand(B, R, generator=g, dtype=torch.float64)
    sampler = trainer + 0.6 * torch.randn(B, R, generator=g, dtype=torch.float64)
    entropy = 2 * torch.rand(B, R, generator=g, dtype=torch.float64)
    return trainer.float(), sampler.float(), entropy.float(), mask


def test_mismatch_metrics_match_their_references():
    """k3 (prime-rl mismatch_kl), its ratio to the mean entropy (kl_ent_ratio), |Δ| > ln 2, NeMo-RL's
    token_mult_prob_error = mean e^|Δ| and its js_divergence_error on the sampled tokens."""
    trainer, sampler, entropy, mask = batch()
    m = S.values(mismatch_metrics(trainer, sampler, entropy, mask))
    rows = [(trainer[i, t].item(), sampler[i, t].item(), entropy[i, t].item())
            for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    k3 = [math.exp(a - b) - (a - b) - 1 for a, b, _ in rows]

    def js(a, b):
        log_m = math.log(0.5 * math.exp(a) + 0.5 * math.exp(b))
        return 0.5 * (math.exp(a - log_m) - (a - log_m) - 1) + 0.5 * (math.exp(b - log_m) - (b - log_m) - 1)

    n = len(rows)
    assert m["mismatch/k3_kl"] == pytest.approx(sum(k3) / n, rel=1e-12)
    assert m["mismatch/kl_ent_ratio"] == pytest.approx(sum(k3) / sum(h for _, _, h in rows), rel=1e-12)
    assert m["mismatch/extreme_frac"] == pytest.approx(sum(abs(a - b) > math.log(2) for a, b, _ in rows) / n)
    assert 0 < m["mismatch/extreme_frac"] < 1
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(a - b)) for a, b, _ in rows) / n,
                                                                rel=1e-12)
    assert m["mismatch/js_divergence"] == pytest.approx(sum(js(a, b) for a, b, _ in rows) / n, rel=1e-9)


def test_mismatch_metrics_pool_exactly_and_are_trivial_without_mismatch():
    """Computed on two halves and combined they equal one call on all rows; trainer == sampler gives k3,
    JS, the extreme fraction 0 and the error 1 exactly."""
    trainer, sampler, entropy, mask = batch(seed=1)
    whole = S.values(mismatch_metrics(trainer, sampler, entropy, mask))
    parts = [S.to_floats(mismatch_metrics(trainer[sl], sampler[sl], entropy[sl], mask[sl]))
             for sl in (slice(0, 2), slice(2, None))]
    split = {k: S.value(v) for k, v in S.combine(parts).items()}
    assert split == pytest.approx(whole, rel=1e-12)
    same = S.values(mismatch_metrics(trainer, trainer, entropy, mask))
    assert same["mismatch/k3_kl"] == 0 and same["mismatch/js_divergence"] == 0
    assert same["mismatch/extreme_frac"] == 0 and same["mismatch/token_mult_prob_error"] == 1
