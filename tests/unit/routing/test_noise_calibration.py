"""moe-rl-calibrate: injections against natural re-routing on one policy."""

import json
import math

import pytest

from moe_rl.calibrate import main, matched

TINY = ["warmstart.enabled=false", "trainer.prompts_per_step=4", "trainer.group_size=4", "sampler.max_new_tokens=6",
        "model.num_layers=2", "logger.progress=false", "objective=grpo"]


def test_matched_interpolates_log_log_between_measured_scales():
    """The scale matching a target change is the log-log interpolation between the bracketing scales;
    a target outside the measured range has none."""
    rows = [{"kind": "logit_noise", "scale": s, "expert_change": c} for s, c in [(0.1, 0.01), (0.4, 0.04), (1.6, 0.08)]]
    got = matched({"rows": rows}, 0.02)
    assert got["logit_noise"] == pytest.approx(math.exp((math.log(0.1) + math.log(0.4)) / 2))
    assert matched({"rows": rows}, 0.2) == {} and matched({"rows": rows}, 0.005) == {}


def test_calibration_runs_end_to_end_and_noise_grows_with_sigma(tmp_path):
    """A tiny calibration writes json, markdown and a figure; logit noise's change grows with σ and with
    staleness, drift and weight noise move routing, and every row pools the same measured tokens; the
    summary of calibrations tabulates its natural change."""
    main([*TINY, "--batches", "1", "--rl-steps", "1", "--lrs", "1e-2", "--drift", "0.1", "--logit-noise", "0.05,0.5",
          "--weight-noise", "0.01", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "calibration.json").read_text())
    rows = {(r["kind"], r["scale"]): r for r in result["rows"]}
    assert set(rows) == {("drift", 0.1), ("logit_noise", 0.05), ("logit_noise", 0.5), ("logit_noise_staleness", 0.05),
                         ("logit_noise_staleness", 0.5), ("weight_noise", 0.01), ("natural", 0.01)}
    assert 0 < rows["logit_noise", 0.05]["expert_change"] < rows["logit_noise", 0.5]["expert_change"]
    assert rows["logit_noise_staleness", 0.5]["expert_change"] > rows["logit_noise", 0.5]["expert_change"]
    assert rows["drift", 0.1]["expert_change"] > 0 and rows["weight_noise", 0.01]["expert_change"] > 0
    assert 0 < rows["logit_noise", 0.05]["predicted_change"] <= 1
    assert len({r["tokens"] for r in result["rows"] if r["kind"] != "logit_noise_staleness"}) == 1
    assert 0 <= result["router"]["margin_p10"] <= result["router"]["margin_median"]
    assert result["config"]["rl_steps"] == 1
    assert "| logit_noise | 0.5 |" in (tmp_path / "calibration.md").read_text()
    assert (tmp_path / "calibration.png").stat().st_size > 10_000
    main(["--summarize", str(tmp_path), "--out", str(tmp_path / "summary")])
    row = (tmp_path / "summary" / "calibration_summary.md").read_text().splitlines()[2].split(" | ")
    natural = rows["natural", 0.01]
    assert row[1] == "8 / 2 / 2" and row[3] == "1" and row[9] == f"{100 * natural['expert_change']:.2f}%"
    change = 100 * natural["expert_change"]
    assert row[11] == (f"{natural['dlogp_mean'] / change:.4f}" if change > 0 else "")  # per point of change


def test_calibration_measures_what_replay_removes_after_k_steps_of_staleness(tmp_path, warm_overrides):
    """--staleness 1,3: one trajectory of 3 real RL steps gives `stale` rows after 1 and 3 steps, each with
    its expert change, the replay-removable damage, the whole damage and the damage per changed expert
    (mean / (change x K x L)); the natural row has its whole damage too; and staleness.png is drawn."""
    tiny = [o for o in TINY if o != "warmstart.enabled=false"]  # a warm start: rewards vary, so updates move
    main([*tiny, *warm_overrides, "trainer.lr=1e-2", "trainer.warmup_steps=0", "--batches", "1", "--rl-steps", "1",
          "--lrs", "1e-2", "--drift", "",
          "--logit-noise", "0.3", "--weight-noise", "", "--staleness", "1,3", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "calibration.json").read_text())
    rows = {(r["kind"], r["scale"]): r for r in result["rows"]}
    slots = result["config"]["top_k"] * result["config"]["layers"]
    assert result["config"]["staleness"] == [1, 3]
    one, three = rows["stale", 1.0], rows["stale", 3.0]
    assert 0 < one["expert_change"] < three["expert_change"]
    for row in (one, three, rows["natural", 0.01]):
        assert row["whole_dlogp_mean"] > 0 and row["dlogp_mean"] >= 0
        if row["expert_change"] > 0:
            assert row["dlogp_per_changed_expert"] == pytest.approx(row["dlogp_mean"] / (row["expert_change"] * slots))
    assert "whole_dlogp_mean" not in rows["logit_noise", 0.3]  # an injection changes no weight
    assert "| stale (k RL steps) | 3 |" in (tmp_path / "calibration.md").read_text()
    assert (tmp_path / "staleness.png").stat().st_size > 10_000


def test_noise_against_natural_damage_at_the_training_lr():
    """The redone dose check: noise's damage per point (per changed expert, K and L cancelling) over the
    natural update's at the training lr, by hand; nan without that row or without change."""
    from moe_rl.calibrate import noise_vs_training_lr

    natural = {"scale": 1e-4, "expert_change": 0.0013, "dlogp_mean": 0.0001}
    noise = {"expert_change": 0.0795, "dlogp_mean": 0.0048}
    assert noise_vs_training_lr(noise, natural) == pytest.approx((0.0048 / 0.0795) / (0.0001 / 0.0013), rel=1e-12)
    assert math.isnan(noise_vs_training_lr(noise, None))
    assert math.isnan(noise_vs_training_lr(noise, {**natural, "expert_change": 0.0}))


def test_damage_per_point_of_expert_change():
    """Mean |Δ log π| over the change in percentage points; empty without a change."""
    from moe_rl.calibrate import damage_per_point

    assert damage_per_point({"dlogp_mean": 0.0041, "expert_change": 0.0497}) == "0.0008"
    assert damage_per_point({"dlogp_mean": 0.01, "expert_change": 0.0}) == "" and damage_per_point(None) == ""


def test_calibration_records_the_router_lr_scale(tmp_path):
    """trainer.router_lr_scale is part of the calibrated policy's config and of its summary row."""
    main([*TINY, "trainer.router_lr_scale=10", "--batches", "1", "--rl-steps", "1", "--lrs", "1e-2", "--drift", "",
          "--logit-noise", "", "--weight-noise", "", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "calibration.json").read_text())["config"]["router_lr_scale"] == 10
    main(["--summarize", str(tmp_path), "--out", str(tmp_path / "summary")])
    assert (tmp_path / "summary" / "calibration_summary.md").read_text().splitlines()[2].split(" | ")[3] == "10"


def test_calibration_refuses_a_perturbed_config(tmp_path):
    """Calibrating a config that already injects a perturbation stops with a message naming it."""
    with pytest.raises(SystemExit, match="routing.drift"):
        main([*TINY, "routing.drift=0.1", "--out", str(tmp_path)])


def test_noise_against_natural_damage_per_point_at_the_nearest_change():
    """The calibration check of confirm_sort_long: logit noise's |Δ log π| per point of change over the
    natural update's at the lr whose change is nearest (log scale), by hand."""
    from moe_rl.calibrate import noise_vs_natural

    natural = [{"scale": 1e-3, "expert_change": 0.0192, "dlogp_mean": 0.0028},
               {"scale": 3e-3, "expert_change": 0.0630, "dlogp_mean": 0.0439},
               {"scale": 1e-4, "expert_change": 0.0, "dlogp_mean": 0.0}]
    ratio, lr = noise_vs_natural({"expert_change": 0.0509, "dlogp_mean": 0.0023}, natural)
    assert lr == 3e-3 and ratio == pytest.approx((0.0023 / 0.0509) / (0.0439 / 0.0630), rel=1e-12)
    ratio, lr = noise_vs_natural({"expert_change": 0.0171, "dlogp_mean": 0.0011}, natural)
    assert lr == 1e-3 and ratio == pytest.approx((0.0011 / 0.0171) / (0.0028 / 0.0192), rel=1e-12)
    assert all(math.isnan(x) for x in noise_vs_natural({"expert_change": 0.0, "dlogp_mean": 0.0}, natural))
    assert all(math.isnan(x) for x in noise_vs_natural({"expert_change": 0.02, "dlogp_mean": 0.001}, natural[2:]))
