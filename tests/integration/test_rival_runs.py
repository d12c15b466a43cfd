"""The 2026 rivals (issue 53) in real RL steps under staleness: every new preset trains, logs its own
metrics finite, and a stale top-k run resumes bit-exactly (the rollouts sampled ahead keep their top-k)."""

import math

import pytest

from moe_rl.trainer.run import build_context
from moe_rl.trainer.step import rl_step
from tests.integration.test_train_loop import TINY, comparable, compose_config, cut_and_uncut

OWN_KEYS = {
    "vespo": ("policy/vespo_phi/mean",),
    "luspo": ("clip/seq_frac",),
    "dppo_tv": ("policy/dppo_truncated_frac", "policy/dppo_divergence/mean", "clip/token_frac"),
    "dppo_kl": ("policy/dppo_divergence/mean", "clip/token_frac"),
    "dppo_topk_tv": ("policy/dppo_divergence/mean", "clip/token_frac"),
    "dppo_topk_kl": ("policy/dppo_divergence/mean", "clip/token_frac"),
    "dppo_prime": ("policy/dppo_divergence/mean", "clip/token_frac"),
}
MISMATCH = ("mismatch/k3_kl", "mismatch/kl_ent_ratio", "mismatch/extreme_frac", "mismatch/token_mult_prob_error",
            "mismatch/js_divergence")


def _base(warm, *extra):
    return [*TINY, *warm, "trainer.lr=1e-2", "trainer.warmup_steps=0", "logger.wandb=false", *extra]


@pytest.mark.parametrize("preset", sorted(OWN_KEYS))
def test_every_rival_trains_under_staleness_and_logs_its_metrics(preset, warm_overrides):
    """Three steps at rollout.staleness=2: the loss and the preset's own metrics are finite at every step,
    the mismatch metrics too, and the stale sampler's mismatch shows (k3 > 0) once the weights moved."""
    ctx, _ = build_context(compose_config(_base(warm_overrides, f"objective={preset}", "rollout.staleness=2",
                                                "trainer.steps=3")))
    for t in range(3):
        metrics = rl_step(ctx, t)
        for key in ("train/loss", *OWN_KEYS[preset], *MISMATCH):
            assert math.isfinite(metrics[key]), (t, key)
    assert metrics["staleness/max"] == 2 and metrics["mismatch/k3_kl"] > 0
    assert metrics["mismatch/token_mult_prob_error"] > 1


def test_a_stale_topk_run_resumes_bit_exactly(tmp_path, warm_overrides):
    """dppo_topk_kl at k = 2, stopped after 3 steps and resumed to 5, logs what an uninterrupted run logs:
    the rollouts waiting in the checkpoint carry the sampler's top-k."""
    cfg = compose_config(_base(warm_overrides, "objective=dppo_topk_kl", "rollout.staleness=2", "trainer.steps=3",
                               "trainer.checkpoint_every=1"))
    cut, uncut = cut_and_uncut(cfg, 5, tmp_path)
    assert comparable(cut) == comparable(uncut)
    assert any(r["policy/dppo_divergence/mean"] > 0 for r in uncut)
