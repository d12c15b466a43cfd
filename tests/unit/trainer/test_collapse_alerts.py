"""Collapse events as W&B alerts and `collapsed:<kind>` run tags, read back from the offline run's records."""

import json
import warnings

import pytest

from moe_rl.trainer.collapse import KINDS, CollapseEvent, counts_by_kind
from moe_rl.trainer.logging import CollapseAlerts, Wandb, open_wandb
from moe_rl.trainer.run import train
from tests.helpers.wandb_offline import of_type
from tests.integration.test_train_loop import TINY, compose_config


def _event(step: int, kind: str = "ratio_blowup") -> dict:
    return {"step": step, "kind": kind, "value": 2000.0, "threshold": 1000.0}


def test_alerts_are_rate_limited_per_kind_and_tag_the_run(tmp_path):
    """An alert per kind at most once per interval (a second kind is not held back); each kind tags the run
    once; the alerts and tags are stored in the offline W&B run."""
    wb = open_wandb(tmp_path, {}, mode="offline", project="moe-rl-test", entity=None, group="g", name="n",
                    tags=["t"])
    assert isinstance(wb, Wandb)
    now = [0.0]
    alerts = CollapseAlerts(wb, interval_s=300.0, kinds=KINDS, clock=lambda: now[0])
    sent = [alerts(_event(1)), alerts(_event(2, "nonfinite"))]
    now[0] = 299.0
    sent.append(alerts(_event(3)))
    now[0] = 301.0
    sent.append(alerts(_event(4)))
    wb.finish()
    assert sent == [True, True, False, True]
    stored = [(a.title, a.text, a.level) for a in of_type(tmp_path, "alert")]
    assert stored == [
        ("ratio_blowup", "step 1: value 2000 crossed threshold 1000", "WARN"),
        ("nonfinite", "step 2: value 2000 crossed threshold 1000", "WARN"),
        ("ratio_blowup", "step 4: value 2000 crossed threshold 1000", "WARN"),
    ]
    assert of_type(tmp_path, "alert")[0].wait_duration == 300_000  # ms: W&B's own limit per title
    assert list(of_type(tmp_path, "run")[-1].tags) == ["t", "collapsed:ratio_blowup", "collapsed:nonfinite"]


def test_resume_tags_past_kinds_again_without_alerting(tmp_path):
    """On resume, the kinds of the events before the checkpoint tag the run again (once each), with no alert."""
    wb = open_wandb(tmp_path, {}, mode="offline", project="moe-rl-test", entity=None, group="g", name="n", tags=[])
    alerts = CollapseAlerts(wb, interval_s=300.0, kinds=KINDS)
    alerts.tag_past([_event(0), _event(1), _event(1, "nonfinite")])
    alerts(_event(2))
    wb.finish()
    assert list(of_type(tmp_path, "run")[-1].tags) == ["collapsed:ratio_blowup", "collapsed:nonfinite"]
    assert [a.text for a in of_type(tmp_path, "alert")] == ["step 2: value 2000 crossed threshold 1000"]


def test_negative_alert_interval_fails_naming_the_field():
    """logger.alert_interval_s < 0 is refused at start-up with an error naming the field."""
    with pytest.raises(ValueError, match="logger.alert_interval_s"):
        compose_config(["logger.alert_interval_s=-1"])


def test_alert_on_a_failed_wandb_run_never_raises(tmp_path):
    """An alert or tag after W&B has failed (the run is finished) warns once and returns instead of raising."""
    wb = open_wandb(tmp_path, {}, mode="offline", project="moe-rl-test", entity=None, group="g", name="n", tags=[])
    wb.run.finish()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CollapseAlerts(wb, interval_s=0.0, kinds=KINDS)(_event(0))
        CollapseAlerts(wb, interval_s=0.0, kinds=KINDS)(_event(1, "nonfinite"))
    assert wb.failed and len([w for w in caught if "W&B call failed" in str(w.message)]) == 1


def test_alerts_and_tags_only_for_the_configured_kinds(tmp_path):
    """With the default logger.alert_kinds a ratio_blowup (a mechanism signal) neither alerts nor tags, while a
    reward_collapse does both; naming ratio_blowup in alert_kinds alerts on it too; an unknown kind is refused
    at start-up naming the field."""
    from moe_rl.config import FAILURE_KINDS, LoggerConfig

    assert LoggerConfig().alert_kinds == list(FAILURE_KINDS) and "ratio_blowup" not in FAILURE_KINDS
    wb = open_wandb(tmp_path, {}, mode="offline", project="moe-rl-test", entity=None, group="g", name="n", tags=[])
    alerts = CollapseAlerts(wb, interval_s=0.0, kinds=LoggerConfig().alert_kinds)
    alerts.tag_past([_event(0)])
    sent = [alerts(_event(1)), alerts(_event(2, "reward_collapse"))]
    wide = CollapseAlerts(wb, interval_s=0.0, kinds=[*FAILURE_KINDS, "ratio_blowup"])
    sent.append(wide(_event(3)))
    wb.finish()
    assert sent == [False, True, True]
    assert [a.title for a in of_type(tmp_path, "alert")] == ["reward_collapse", "ratio_blowup"]
    assert list(of_type(tmp_path, "run")[-1].tags) == ["collapsed:reward_collapse", "collapsed:ratio_blowup"]
    with pytest.raises(ValueError, match=r"logger.alert_kinds=.*unknown kind\(s\) \['ratio'\]"):
        compose_config(["logger.alert_kinds=[ratio]"])


def test_counts_by_kind_counts_every_kind():
    """collapse/kind/<kind> counts each kind's events and is 0 for every kind that has not fired."""
    events = [CollapseEvent(0, "ratio_blowup", 2e3, 1e3), CollapseEvent(1, "ratio_blowup", 3e3, 1e3),
              CollapseEvent(1, "nonfinite", float("nan"), float("inf"))]
    counts = counts_by_kind(events)
    assert counts == {"collapse/kind/nonfinite": 1.0, "collapse/kind/reward_collapse": 0.0,
                      "collapse/kind/eval_regression": 0.0, "collapse/kind/entropy_collapse": 0.0,
                      "collapse/kind/ratio_blowup": 2.0}
    assert set(counts) == {f"collapse/kind/{k}" for k in KINDS}


@pytest.mark.slow
def test_unstable_run_alerts_and_tags_each_collapse_kind(tmp_path, warm_overrides):
    """A run that collapses (lr=10), alerted on every kind, tags its W&B run collapsed:<kind> for exactly the
    kinds in events.jsonl, alerts once per kind (rate limit), and logs per-kind counts that match the events."""
    cfg = compose_config([*TINY, *warm_overrides, "objective=grpo", "trainer.lr=10.0", f"logger.alert_kinds=[{','.join(KINDS)}]",
                          "trainer.warmup_steps=0", "trainer.steps=4", "collapse.warmup_steps=1"])
    summary = train(cfg, tmp_path)
    kinds = {e["kind"] for e in summary["collapse_events"]}
    assert kinds, "no collapse event at lr=10"
    tags = set(of_type(tmp_path, "run")[-1].tags)
    assert {t for t in tags if t.startswith("collapsed:")} == {f"collapsed:{k}" for k in kinds}
    assert sorted(a.title for a in of_type(tmp_path, "alert")) == sorted(kinds)
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    for kind in KINDS:
        assert last[f"collapse/kind/{kind}"] == sum(e["kind"] == kind for e in summary["collapse_events"])
