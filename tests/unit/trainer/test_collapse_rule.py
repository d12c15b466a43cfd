"""The reward-collapse and eval-regression tests (moe_rl.trainer.changepoint, moe_rl.trainer.collapse): the
CUSUM against a float64 reference written out here, its threshold against Siegmund's formula, its false
alarms and detection on simulated rewards, recovery, and exact resume of its state."""

import io
import math

import numpy as np
import pytest
import torch

from moe_rl.config import CollapseConfig
from moe_rl.trainer.changepoint import MIN_H_PER_K, LevelDrop, cusum_threshold, siegmund_arl
from moe_rl.trainer.collapse import CollapseDetector
from moe_rl.trainer.step_metrics import rollout_metrics


def reference_cusum(xs, ses, frac, window, arl0, margin, min_h_per_k=2.0):
    """The rule as the module docstring states it, in plain float64 numpy: returns the indices that fire."""
    ref, exc, s, drop, fired = [], [], 0.0, False, []
    for t, (x, se) in enumerate(zip(xs, ses, strict=True)):
        if not (np.isfinite(x) and np.isfinite(se)):
            continue
        ready = len(ref) == window
        if ready:
            xr, vr = np.array(ref, dtype=np.float64).T
            mu, sigma = xr.mean(), np.sqrt(vr.mean() * (1 + 1 / window))
            ready = mu > 0 and sigma > 0
        if not ready:
            ref = (ref + [(x, se * se)])[-window:]
            continue
        k = (1 - frac) * mu / (2 * sigma)
        h = max(reference_threshold(k, arl0), min_h_per_k * k)  # the reward test's floor: 2k
        s = max(0.0, s + (mu - margin * sigma / np.sqrt(window) - x) / sigma - k)
        if drop:
            if s == 0:
                drop, ref, exc = False, [], []
            s = min(s, h)
        elif s > h:
            fired.append(t)
            drop, exc = True, []
        elif s == 0:
            ref, exc = (ref + exc + [(x, se * se)])[-window:], []
        else:
            exc = (exc + [(x, se * se)])[-window:]
    return fired


def reference_threshold(k, arl0):
    """h solving Siegmund's ARL(k, h) = (exp(2kb) - 2kb - 1) / (2k^2) = arl0, b = h + 1.166 (b^2 as k -> 0),
    by scipy's brentq; 0 when even h = 0 exceeds arl0."""
    from scipy.optimize import brentq

    def excess(b):
        return b * b - arl0 if k < 1e-8 else (np.expm1(2 * k * b) - 2 * k * b) / (2 * k * k) - arl0

    return max(0.0, brentq(excess, 1e-9, 300 / max(k, 0.1)) - 1.166) if excess(1.166) < 0 else 0.0


def simulated_rewards(p, steps, prompts, group, icc, seed, fall_at=None, fall_to=1.0):
    """Per-step mean reward and its group standard error, as rollout_metrics computes them, for Bernoulli
    rewards whose prompts differ in difficulty (Beta of mean p, intra-group correlation icc)."""
    rng = np.random.default_rng(seed)
    mult = np.ones(steps)
    if fall_at is not None:
        mult[fall_at:] = fall_to
    kappa = 1 / icc - 1
    p_SP = rng.beta(p * kappa, (1 - p) * kappa, size=(steps, prompts)) * mult[:, None]
    hits = rng.random((steps, prompts, group)) < p_SP[..., None]
    out = [rollout_metrics([[float(r), 1.0, 1.0, 0.0] for r in step.reshape(-1)], group) for step in hits]
    return [m["rollout/reward/mean"] for m in out], [m["rollout/reward/se"] for m in out]


def test_reward_se_is_the_spread_of_group_means():
    """rollout/reward/se is the sample sd of the P group means over sqrt(P) (float64 numpy), NaN for one group."""
    rewards = [1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    rows = [[float(r), 1.0, 1.0, 0.0] for r in rewards]
    groups = np.array(rewards, dtype=np.float64).reshape(3, 4).mean(1)
    assert rollout_metrics(rows, 4)["rollout/reward/se"] == pytest.approx(groups.std(ddof=1) / np.sqrt(3), rel=1e-12)
    assert math.isnan(rollout_metrics(rows, 12)["rollout/reward/se"])


def test_threshold_inverts_siegmunds_formula():
    """cusum_threshold(k, arl0) gives the h at which Siegmund's ARL equals arl0 (k from 0 to 3), and the
    ARL grows with h."""
    for k in (0.0, 0.05, 0.3, 1.0, 3.0):
        h = cusum_threshold(k, 2e4)
        assert siegmund_arl(k, h) == pytest.approx(2e4, rel=1e-9)
        assert siegmund_arl(k, h + 0.1) > siegmund_arl(k, h)
    assert siegmund_arl(0.0, 2.0) == pytest.approx((2 + 1.166) ** 2)
    assert siegmund_arl(1e4, 0.0) == math.inf and cusum_threshold(1e4, 2e4) == 0.0  # no overflow


@pytest.mark.parametrize("icc, p, fall_to", [(0.3, 0.2, 0.25), (0.5, 0.5, 0.5), (0.3, 0.2, 1.0), (0.3, 0.1, 0.0)])
def test_rule_matches_the_float64_reference(icc, p, fall_to):
    """On simulated rewards (flat, falling, falling to 0, with recovery after a fall back up) LevelDrop fires
    at exactly the steps the float64 reference of the same rule does."""
    xs, ses = simulated_rewards(p, 300, 16, 8, icc, seed=3, fall_at=80, fall_to=fall_to)
    xs = xs[:200] + [x / max(fall_to, 1e-9) if fall_to else p for x in xs[200:]]  # back up after step 200
    cfg = CollapseConfig()
    test = LevelDrop(cfg.reward_frac, cfg.reward_window, cfg.reward_arl0, cfg.reward_margin, 2.0)
    fired = [t for t, (x, se) in enumerate(zip(xs, ses, strict=True)) if test.update(x, se)]
    assert fired == reference_cusum(xs, ses, cfg.reward_frac, cfg.reward_window, cfg.reward_arl0, cfg.reward_margin)
    if fall_to < 1:
        assert fired and 80 <= fired[0] < 100  # the fall is found within 20 steps


@pytest.mark.parametrize("p, prompts, group, icc", [
    (0.2, 16, 8, 0.3),  # the default scale: measured rate under 0.02
    (0.95, 4, 4, 0.6),  # the cell the fourth probe round found failing (nearly every run fired before the floor)
])
def test_flat_runs_rarely_fire_and_falls_are_found(p, prompts, group, icc):
    """Over 40 simulated flat 300-step runs the detector fires on at most 2; a fall to 0.25x at step 50 is
    found within 20 steps in at least 38 of 40. At reward 0.95 with 4 prompts x 4 one hard prompt halves a
    step's mean, which the threshold's 2k floor keeps from firing alone."""
    cfg = CollapseConfig()
    flat = falls = 0
    for seed in range(40):
        det = CollapseDetector(cfg)
        xs, ses = simulated_rewards(p, 300, prompts, group, icc, seed)
        flat += any(_observe(det, t, x, se) for t, (x, se) in enumerate(zip(xs, ses, strict=True)))
        det = CollapseDetector(cfg)
        xs, ses = simulated_rewards(p, 70, prompts, group, icc, 1000 + seed, fall_at=50, fall_to=0.25)
        steps = [t for t, (x, se) in enumerate(zip(xs, ses, strict=True)) if _observe(det, t, x, se)]
        falls += bool(steps) and 50 <= steps[0] < 70
    assert flat <= 2 and falls >= 38


def _observe(det: CollapseDetector, step: int, reward: float, se: float) -> bool:
    metrics = {"rollout/reward/mean": reward, "rollout/reward/se": se, "rollout/entropy/mean": 1.0,
               "ratio/token/max": 1.0, "ratio/token/min": 1.0}
    return any(e.kind == "reward_collapse" for e in det.observe(step, metrics))


def test_fires_once_per_collapse_and_again_after_recovery():
    """A fall fires once however long it lasts; after the reward comes back and a new reference fills, a
    second fall fires again; the event carries the reference it fell from."""
    det = CollapseDetector(CollapseConfig())
    series = [0.4] * 40 + [0.05] * 30 + [0.4] * 40 + [0.05] * 10
    fired = [t for t, x in enumerate(series) if _observe(det, t, x, 0.03)]
    assert len(fired) == 2 and 40 <= fired[0] < 43 and 110 <= fired[1] < 113
    event = det.events[0]
    assert event.kind == "reward_collapse" and event.value == 0.05
    assert event.detail["reference"] == pytest.approx(0.4 - 0.03 * math.sqrt(1 + 1 / 20) / math.sqrt(20))
    assert event.threshold == pytest.approx(0.75 * event.detail["reference"])


def test_a_drop_with_no_threshold_ends_only_when_the_level_is_back():
    """With noise so small that h = 0 (one low observation fires), the drop lasts while observations stay
    below the reference's midpoint and ends at the first one back up; then a new reference fills and a
    second fall fires again."""
    test = LevelDrop(0.5, 3, 1e3)
    series = [0.4] * 3 + [0.1] * 4 + [0.4] + [0.4] * 3 + [0.1]
    fired = [t for t, x in enumerate(series) if test.update(x, 1e-4)]
    assert test.reference() is not None and fired == [3, 11]


def test_missing_or_nan_se_is_not_an_observation():
    """A step without rollout/reward/se (a log from before it existed) or with NaN (one group) neither fills
    the reference nor fires."""
    det = CollapseDetector(CollapseConfig())
    for t in range(60):
        det.observe(t, {"rollout/reward/mean": 0.0 if t > 30 else 0.5, "rollout/entropy/mean": 1.0,
                        "ratio/token/max": 1.0, "ratio/token/min": 1.0,
                        **({"rollout/reward/se": math.nan} if t % 2 else {})})
    assert det.events == [] and det.reward.ref == []


def test_resume_mid_excursion_is_exact():
    """Detector state saved mid-run (inside an excursion and inside a drop) through torch.save and restored
    into a fresh detector gives exactly the events and state an uninterrupted detector does."""
    xs, ses = simulated_rewards(0.3, 160, 16, 8, 0.3, seed=5, fall_at=60, fall_to=0.3)
    full = CollapseDetector(CollapseConfig())
    for t, (x, se) in enumerate(zip(xs, ses, strict=True)):
        _observe(full, t, x, se)
    for cut in (45, 62, 100):
        det = CollapseDetector(CollapseConfig())
        for t in range(cut):
            _observe(det, t, xs[t], ses[t])
        buf = io.BytesIO()
        torch.save(det.state_dict(), buf)
        buf.seek(0)
        resumed = CollapseDetector(CollapseConfig())
        resumed.load_state_dict(torch.load(buf, weights_only=True))
        for t in range(cut, len(xs)):
            _observe(resumed, t, xs[t], ses[t])
        assert repr(resumed.state_dict()) == repr(full.state_dict()), cut  # repr: NaN == NaN
    assert any(e.kind == "reward_collapse" for e in full.events)


def test_eval_regression_fires_on_a_fall_of_expected_accuracy():
    """eval_regression watches eval/expected_accuracy with its own window (the initial evaluation counts):
    steady evaluations never fire, a fall to 0.4x fires at that evaluation, once."""
    det = CollapseDetector(CollapseConfig())
    det.observe_eval(0, {"eval/initial/expected_accuracy": 0.30, "eval/initial/expected_accuracy/se": 0.01},
                     prefix="eval/initial/")
    values = [0.31, 0.33, 0.34, 0.35, 0.14, 0.12, 0.13]
    fired = [9 + 10 * i for i, v in enumerate(values)
             if det.observe_eval(9 + 10 * i, {"eval/expected_accuracy": v, "eval/expected_accuracy/se": 0.01})]
    assert fired == [49] and [e.kind for e in det.events] == ["eval_regression"]
    assert det.observe_eval(99, {"eval/accuracy": 0.0}) == []  # no expected accuracy logged: no observation


def test_collapse_config_fails_naming_the_field():
    """Each bad collapse.* value fails at start-up with a message naming its field."""
    from tests.integration.test_train_loop import compose_config

    for override, field in [("collapse.reward_frac=1.5", "collapse.reward_frac"),
                            ("collapse.eval_window=0", "collapse.eval_window"),
                            ("collapse.reward_arl0=0", "collapse.reward_arl0"),
                            ("collapse.reward_margin=-1", "collapse.reward_margin"),
                            ("collapse.ratio_max=1", "collapse.ratio_max"),
                            ("collapse.stop_kinds=[collapse]", "collapse.stop_kinds")]:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            compose_config([override])


def test_the_reward_tests_floor_needs_more_than_one_observation_past_the_midpoint():
    """Issue 56: with the noise far smaller than the fall (Siegmund's h = 0), one observation at 0.4x the
    reference fires a test without the floor, not the reward test's (h >= 2k: alone, only below 0.25x);
    a second one fires it; one at 0.2x fires it at once."""
    for floor, series, fires_at in ((0.0, [0.4] * 20 + [0.16], 20), (2.0, [0.4] * 20 + [0.16], None),
                                    (2.0, [0.4] * 20 + [0.16, 0.16], 21), (2.0, [0.4] * 20 + [0.08], 20)):
        test = LevelDrop(0.5, 20, 2e4, 1.0, floor)
        fired = [t for t, x in enumerate(series) if test.update(x, 0.004)]
        assert fired == ([] if fires_at is None else [fires_at]), (floor, series[20:])


def test_a_checkpoint_from_before_the_floor_resumes_with_it():
    """A detector state saved before `min_h_per_k` existed resumes with the reward test's floor (MIN_H_PER_K)
    and the eval test's none, not the dataclass default for both."""
    det = CollapseDetector(CollapseConfig())
    state = det.state_dict()
    for name in ("reward", "eval"):
        del state[name]["min_h_per_k"]
    resumed = CollapseDetector(CollapseConfig())
    resumed.load_state_dict(state)
    assert (resumed.reward.min_h_per_k, resumed.eval.min_h_per_k) == (MIN_H_PER_K, 0.0) and MIN_H_PER_K > 0
