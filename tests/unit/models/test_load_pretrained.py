"""Pretrained MoE configs (Qwen3-MoE, OLMoE, Qwen1.5-MoE, Mixtral) on tiny locally saved models; nothing is
downloaded. Also routing replay through the trainer under gradient checkpointing."""

import math

import pytest
import torch

from moe_rl.models import ModelConfig, build_model, build_tokenizer
from moe_rl.rollout import sample
from moe_rl.trainer.batch import Batch
from moe_rl.trainer.plan import RoutingPlan
from moe_rl.trainer.run import build_context, train
from moe_rl.trainer.samplers import chat_prompt
from moe_rl.trainer.step import old_policy, update
from moe_rl.warmstart import warm_start
from tests.integration.test_train_loop import TINY, comparable, compose_config, read_metrics

CONFIGS = {
    "qwen3_moe": "qwen3_30b_a3b",
    "olmoe": "olmoe_1b_7b",
    "qwen2_moe": "qwen1_5_moe_a2_7b",
    "mixtral": "mixtral_8x7b",
}
# A chat template over the task alphabet (the tiny character tokenizer has no '|' or newline), writing BOS
# as real templates do: the trainer must not double it.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>:{{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}<assistant>:{% endif %}"
)
CPU = ["trainer.device=cpu", "logger.wandb=false"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny model of each family saved with a tokenizer that has a chat template: {family: path}."""
    root = tmp_path_factory.mktemp("pretrained")
    paths = {}
    for family in CONFIGS:
        tokenizer = build_tokenizer()
        tokenizer.chat_template = TEMPLATE
        cfg = ModelConfig(family=family, num_layers=2, head_dim=None if family == "olmoe" else 32)
        path = root / family
        build_model(cfg, tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[family] = path
    return paths


def test_pretrained_configs_set_memory_settings():
    """Each real-checkpoint config loads in bf16 with gradient checkpointing, grouped_mm experts and the chat
    template, on CUDA, with no warm start."""
    for name in CONFIGS.values():
        cfg = compose_config([f"model={name}"])
        m = cfg.model
        assert m.pretrained and (m.dtype, m.gradient_checkpointing, m.experts_impl) == (
            "bfloat16",
            True,
            "grouped_mm",
        )
        assert cfg.task.chat_template and not cfg.warmstart.enabled and cfg.trainer.device == "cuda"


def test_chat_template_wraps_prompts_without_doubling_bos(saved):
    """The prompt is one user turn ending where the answer starts; the template's BOS is left to the tokenizer."""
    cfg = compose_config([*TINY, "model=olmoe_1b_7b", f"model.pretrained={saved['olmoe']}", *CPU])
    ctx, _ = build_context(cfg)
    assert ctx.prompt("1+2=") == "<user>:1+2=;<assistant>:"
    ids = ctx.tokenizer(ctx.prompt("1+2="))["input_ids"]
    assert ids.count(ctx.tokenizer.bos_token_id) == 1 and ctx.tokenizer.unk_token_id not in ids
    assert chat_prompt(ctx.tokenizer, "x") == "<user>:x;<assistant>:"


def test_chat_template_needs_a_template_and_no_warm_start():
    """task.chat_template=true fails fast on a tokenizer without a template, and alongside a warm start."""
    with pytest.raises(ValueError, match="task.chat_template"):
        build_context(compose_config([*TINY, "task.chat_template=true", "warmstart.enabled=false", *CPU]))
    with pytest.raises(ValueError, match="task.chat_template"):
        compose_config([*TINY, "task.chat_template=true"])


@pytest.mark.parametrize(
    "family",
    ["qwen3_moe", *(pytest.param(f, marks=pytest.mark.slow) for f in ("olmoe", "qwen2_moe", "mixtral"))],
)
def test_pretrained_family_trains_through_its_config(tmp_path, saved, family):
    """A saved tiny model of each family runs RL through its real-checkpoint config (bf16, checkpointing,
    grouped_mm, chat template) on CPU, and an update with non-zero advantages moves its parameters."""
    cfg = compose_config(
        [
            *TINY,
            f"model={CONFIGS[family]}",
            f"model.pretrained={saved[family]}",
            *CPU,
            "trainer.steps=1",
            "trainer.lr=1e-2",
            "objective=grpo_rr",
        ]
    )
    summary = train(cfg, tmp_path)
    assert summary["steps_done"] == 1 and math.isfinite(summary["final"]["train/loss"])
    ctx, _ = build_context(cfg)
    assert ctx.model.config.model_type == family
    assert next(ctx.model.parameters()).dtype == torch.bfloat16
    roll = sample(
        ctx.model,
        ctx.tokenizer,
        [ctx.prompt(p) for p in ["1+2=", "3-1="] * 4],
        cfg.sampler,
        generator=torch.Generator().manual_seed(0),
        controller=ctx.controller,
    )
    batch = Batch.from_rollout(
        roll, torch.randn(8, generator=torch.Generator().manual_seed(1)), torch.arange(8)
    )
    batch.minibatches = [slice(0, 8)]
    plan = RoutingPlan(cfg.routing, ctx.controller, batch, 0, cfg.seed)
    old = old_policy(ctx.forwards, batch, plan)
    before = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    metrics = update(ctx.forwards, ctx.stepper, ctx.objective, batch, old, plan, 0).metrics
    assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in ctx.model.state_dict().items())


@pytest.mark.slow
def test_replay_through_trainer_under_gradient_checkpointing(tmp_path, warm_overrides):
    """GRPO with routing replay trains the same with model.gradient_checkpointing=true as without: the router
    hooks run again in the recompute and route by the replayed ids."""
    base = compose_config([*TINY, *warm_overrides])
    ws = warm_start(
        base.model,
        base.task.name,
        base.task.difficulty,
        base.warmstart,
        base.seed,
        max_new_tokens=base.sampler.max_new_tokens,
        progress=False,
    )
    runs = {}
    for ckpt in (False, True):
        cfg = compose_config(
            [
                *TINY,
                "warmstart.enabled=false",
                f"model.pretrained={ws.path}",
                "objective=grpo_rr",
                f"model.gradient_checkpointing={ckpt}",
                "logger.wandb=false",
                "trainer.lr=1e-3",
            ]
        )
        summary = train(cfg, tmp_path / str(ckpt))
        runs[ckpt] = (summary, read_metrics(tmp_path / str(ckpt)))
    assert runs[True][0]["final"]["train/grad_norm"] > 0
    assert comparable(runs[True][1]) == comparable(runs[False][1])


def test_sigmoid_gated_pretrained_model_is_refused_at_start_up(tmp_path):
    """`model.pretrained=` of a sigmoid-gated family (a MiniMax-M2 saved here) exits at start-up with one
    line naming its router, before any RL step is logged: replay would otherwise use wrong gates."""
    import subprocess
    import sys

    import transformers

    tokenizer = build_tokenizer()
    cfg = transformers.MiniMaxM2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2,
        rotary_dim=8, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for block in model.model.layers:
            block.mlp.gate.weight.normal_(0, 1.0)
    model.save_pretrained(tmp_path / "minimax")
    tokenizer.save_pretrained(tmp_path / "minimax")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_rl.train", f"model.pretrained={tmp_path / 'minimax'}", "model.family=qwen3_moe",
         "warmstart.enabled=false", "logger=none", "logger.progress=false", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=300,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Loading weights" not in line]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(lines) == 1 and "MiniMaxM2TopKRouter" in lines[0], proc.stderr[-2000:]
    assert not (run_dir / "metrics.jsonl").exists()
