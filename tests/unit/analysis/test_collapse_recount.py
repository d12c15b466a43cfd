"""`moe-rl-analyze --recount`: the current collapse rule replayed over logged metrics equals the live detector,
keeps the kinds whose rule did not change, and rewrites the counts the tables read."""

import json
import math
from dataclasses import asdict, replace

from analysis.cli import main as analyze
from analysis.load import Run, read_local_run
from analysis.pairs import collapsed
from analysis.recount import recount
from moe_rl.config import CollapseConfig
from moe_rl.trainer.run import train
from tests.integration.test_train_loop import TINY, compose_config


def _config(warmup=5, prompts=16, expected_size=512):
    return {"collapse": {"warmup_steps": warmup}, "trainer": {"prompts_per_step": prompts},
            "eval": {"expected_size": expected_size}, "objective": {"preset": "grpo"}, "routing": {"replay": "off"},
            "seed": 0}


def test_an_old_log_is_recounted_with_the_conservative_se():
    """A log without rollout/reward/se (std only; a flat reward at 0.4 falling to 0.02 at step 40) gets one
    reward_collapse soon after the fall from std / sqrt(P); an old rule's reward_collapse at a noisy step is
    dropped, its ratio_blowup kept, and every row's counts follow the new events."""
    rows = [{"step": t, "rollout/reward/mean": 0.4 + 0.05 * (-1) ** t if t < 40 else 0.02,
             "rollout/reward/std": 0.49, "collapse/events": 0.0} for t in range(60)]
    old = [{"step": 12, "kind": "reward_collapse", "value": 0.35, "threshold": 0.4, "detail": None},
           {"step": 30, "kind": "ratio_blowup", "value": 2e3, "threshold": 1e3, "detail": {"high": 2e3}}]
    run = recount(Run(config=_config(), rows=rows, events=old, source="synthetic"))
    kinds = [(e["step"], e["kind"]) for e in run.events]
    assert kinds[0] == (30, "ratio_blowup") and [k for _, k in kinds[1:]] == ["reward_collapse"]
    assert 40 <= kinds[1][0] < 45
    first = run.events[1]["step"]
    assert [r["collapse/events"] for r in run.rows][29:31] == [0.0, 1.0] and run.rows[-1]["collapse/events"] == 2.0
    assert run.rows[first]["collapse/new_events"] == 1.0 and run.rows[first]["collapse/kind/reward_collapse"] == 1.0
    assert run.rows[12]["collapse/kind/reward_collapse"] == 0.0


def test_recount_of_a_real_run_equals_its_live_events(tmp_path, warm_overrides):
    """A tiny run logged with the current detector (tuned to fire easily) and replayed from its metrics.jsonl
    with the same CollapseConfig gives exactly the reward_collapse and eval_regression events it logged live;
    moe-rl-analyze --recount writes a report from the re-counted runs."""
    overrides = ["objective=grpo", "trainer.steps=10", "trainer.lr=3.0", "trainer.warmup_steps=0",
                 "collapse.warmup_steps=0", "collapse.reward_window=2", "collapse.reward_arl0=2",
                 "collapse.eval_window=1", "collapse.eval_arl0=1", "eval.every=1", "eval.at_start=true",
                 "logger.wandb=false"]
    cfg = compose_config([*TINY, *warm_overrides, *overrides])
    summary = train(cfg, tmp_path / "run")
    live = [e for e in summary["collapse_events"] if e["kind"] in ("reward_collapse", "eval_regression")]
    assert live, "the tuned detector found nothing to compare"
    run = read_local_run(tmp_path / "run")
    replayed = recount(run, replace(cfg.collapse, warmup_steps=0))
    again = [e for e in replayed.events if e["kind"] in ("reward_collapse", "eval_regression")]
    assert json.dumps(again, sort_keys=True) == json.dumps(live, sort_keys=True)
    assert [r["collapse/events"] for r in replayed.rows] == [r["collapse/events"] for r in run.rows]
    assert collapsed(replayed) == collapsed(run)
    analyze([str(tmp_path / "run"), "--out", str(tmp_path / "report"), "--recount", "--no-progress"])
    assert "re-counted" in (tmp_path / "report" / "report.md").read_text()


def test_default_rule_is_what_recount_uses():
    """Without a config recount replays the current defaults (the run's own warm-up aside)."""
    rows = [{"step": t, "rollout/reward/mean": 0.3, "rollout/reward/se": 0.02} for t in range(30)]
    run = recount(Run(config=_config(warmup=0), rows=rows, events=[], source="s"))
    assert run.events == [] and all(r["collapse/events"] == 0.0 for r in run.rows)
    assert asdict(CollapseConfig())["reward_window"] == 20 and math.isfinite(CollapseConfig().reward_arl0)


def test_recount_without_expected_accuracy_is_no_division_by_zero():
    """Issue 56: eval.expected_size=0 (expected accuracy off) recounts the reward rule and leaves the eval
    rule without observations, instead of a ZeroDivisionError."""
    rows = [{"step": t, "rollout/reward/mean": 0.4, "rollout/reward/std": 0.49, "collapse/events": 0.0,
             "eval/expected_accuracy": 0.3} for t in range(30)]
    run = recount(Run(config=_config(expected_size=0), rows=rows, events=[], source="synthetic"))
    assert run.events == [] and run.rows[-1]["collapse/events"] == 0.0
