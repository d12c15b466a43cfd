"""The trained policy in Hugging Face format: policy/ loads with from_pretrained and continues training."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import moe_rl.trainer.checkpointer as checkpointer_module
from moe_rl.trainer.checkpoint import read_checkpoint
from moe_rl.trainer.export import export_policy
from moe_rl.trainer.run import build_context, train
from moe_rl.trainer.step import rl_step
from tests.integration.test_train_loop import TINY, compose_config

BASE = [*TINY, "warmstart.enabled=false", "logger.wandb=false", "objective=grpo", "trainer.lr=1e-2",
        "trainer.warmup_steps=0"]


def test_from_pretrained_gives_identical_logits(tmp_path):
    """A policy trained in memory for one step and exported loads with AutoModelForCausalLM.from_pretrained and
    gives bitwise the same logits; its tokenizer encodes a prompt to the same ids; moe_rl.json has the step,
    the metrics and the config."""
    cfg = compose_config(BASE)
    ctx, _ = build_context(cfg)
    metrics = rl_step(ctx, 0)
    path = export_policy(tmp_path, ctx.model, ctx.tokenizer, config={"seed": 0}, step=1, metrics=metrics)
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([ctx.tokenizer("12+34=5")["input_ids"]] * 2)
    assert tokenizer("12+34=5")["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ctx.model(ids).logits, rtol=0, atol=0)
    info = json.loads((path / "moe_rl.json").read_text())
    assert info["step"] == 1 and info["config"] == {"seed": 0}
    assert info["metrics"]["train/loss"] == metrics["train/loss"]


def _spy_exports(monkeypatch) -> list[int]:
    """Record the step of every export the run makes (the real export still runs)."""
    steps = []

    def spy(*args, **kwargs):
        steps.append(kwargs["step"])
        return export_policy(*args, **kwargs)

    monkeypatch.setattr(checkpointer_module, "export_policy", spy)
    return steps


def test_run_writes_policy_equal_to_its_last_checkpoint(tmp_path, monkeypatch):
    """A run exports once, at its end (not at its other checkpoints), policy/ holding exactly the final
    checkpoint's weights and moe_rl.json the run's config and final metrics (those of summary.json)."""
    exports = _spy_exports(monkeypatch)
    summary = train(compose_config([*BASE, "trainer.checkpoint_every=1"]), tmp_path)
    assert exports == [2]
    state = read_checkpoint(tmp_path / "checkpoint.pt")["model"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").state_dict()
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
    info = json.loads((tmp_path / "policy" / "moe_rl.json").read_text())
    assert info["step"] == summary["steps_done"] == 2 and info["metrics"] == summary["final"]
    assert info["config"]["objective"]["preset"] == "grpo" and info["config"]["trainer"]["steps"] == 2


def test_export_hf_exports_at_every_checkpoint(tmp_path, monkeypatch):
    """trainer.export_hf=true exports at every checkpoint, leaving the last one in policy/."""
    exports = _spy_exports(monkeypatch)
    train(compose_config([*BASE, "trainer.checkpoint_every=1", "trainer.export_hf=true"]), tmp_path)
    assert exports == [1, 2]
    assert json.loads((tmp_path / "policy" / "moe_rl.json").read_text())["step"] == 2
    assert not list(tmp_path.glob(".policy*")), "no temporary export folder is left behind"


@pytest.mark.slow
def test_pretrained_policy_continues_training(tmp_path, warm_overrides):
    """model.pretrained=<run>/policy starts a new run from exactly the exported weights (so it keeps the
    warm-started policy's nonzero reward) and trains them further."""
    first = [*TINY, *warm_overrides, "logger.wandb=false", "objective=grpo"]
    train(compose_config(first), tmp_path / "first")
    policy = tmp_path / "first" / "policy"
    cfg = compose_config([*BASE, f"model.pretrained={policy}"])
    ctx, _ = build_context(cfg)
    exported = read_checkpoint(tmp_path / "first" / "checkpoint.pt")["model"]
    for key, value in ctx.model.state_dict().items():
        assert torch.equal(value, exported[key]), key
    train(cfg, tmp_path / "second")
    rows = [json.loads(line) for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["rollout/reward/mean"] > 0, "a model built from config has reward 0 on this task"
    trained = read_checkpoint(tmp_path / "second" / "checkpoint.pt")["model"]
    assert any(not torch.equal(trained[k], exported[k]) for k in exported), "the second run did not train"
