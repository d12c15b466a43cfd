"""The warm start's broad-mixture pretraining (warmstart.pretrain_steps) and its mixture task."""

import json
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import moe_rl.warmstart.pretrain as pretrain_mod
from moe_rl.models import ModelConfig
from moe_rl.tasks import TASKS, BroadTask
from moe_rl.warmstart import WarmStartConfig, cache_key, warm_start
from tests.unit.warmstart.test_warm_start_build_and_cache import FAST, TINY, weights_of

DEFAULT_KEY = "5e8089100c80fb1be1a00ee9d862783708727f670cce3f9af3955930d02d415c"
"""cache_key(ModelConfig(), "arithmetic", 1, WarmStartConfig(), 0, 32) before pretraining existed."""
MIXED_KEY = "41ef417d22fad47e86cae540c06d681814330bbc38418a1e44ec6523586d1a36"
"""The key of a non-default config (fine-grained, aux 0.01, lr 1e-3, task.mix) before pretraining existed."""


def test_keys_of_entries_built_without_pretraining_are_unchanged():
    """With pretrain_steps = 0 the key is the one computed before the pretraining fields existed, whatever
    pretrain_aux_loss_coef says: cached warm starts and published results keep their entries."""
    assert cache_key(ModelConfig(), "arithmetic", 1, WarmStartConfig(), 0, 32) == DEFAULT_KEY
    assert cache_key(ModelConfig(), "arithmetic", 1, WarmStartConfig(pretrain_aux_loss_coef=0.5), 0, 32) == DEFAULT_KEY
    fine = ModelConfig(num_experts=64, top_k=8, expert_ffn_size=32, router_aux_loss_coef=0.01)
    assert cache_key(fine, "sort", 4, WarmStartConfig(lr=1e-3), 3, 8, mix=[2, 4]) == MIXED_KEY


def test_pretraining_fields_change_the_key():
    """pretrain_steps > 0 changes the key, and so do a different step count and coefficient."""
    m = ModelConfig()
    keys = {
        cache_key(m, "arithmetic", 1, ws, 0, 32)
        for ws in (
            WarmStartConfig(),
            WarmStartConfig(pretrain_steps=50),
            WarmStartConfig(pretrain_steps=100),
            WarmStartConfig(pretrain_steps=50, pretrain_aux_loss_coef=0.1),
        )
    }
    assert len(keys) == 4


@pytest.mark.parametrize("field, value", [("pretrain_steps", -1), ("pretrain_aux_loss_coef", -0.01),
                                          ("pretrain_aux_loss_coef", float("nan"))])
def test_invalid_pretraining_field_raises_naming_it(tmp_path, field, value):
    """A negative (or NaN) pretraining field raises ValueError naming warmstart.<field>, before anything is written."""
    cfg = replace(WarmStartConfig(cache_dir=str(tmp_path / "cache")), **{field: value})
    with pytest.raises(ValueError, match=rf"warmstart\.{field}"):
        warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False)
    assert not (tmp_path / "cache").exists()


def test_broad_task_draws_every_family_at_every_difficulty_reproducibly():
    """2000 draws cover every (family, difficulty) pair; demonstrations score 1; same seed, same examples."""
    task = BroadTask(TASKS)
    examples = task.examples("train", 2000, seed=0)
    pairs = Counter((task.family_of(ex), task.difficulty_of(ex)) for ex in examples)
    assert set(pairs) == {(n, d) for n, c in TASKS.items() for d in range(c.min_difficulty, c.max_difficulty + 1)}
    assert all(task.reward(ex, task.solve(ex)) == 1.0 for ex in examples)
    assert not task.is_correct(examples[0], "garbage")
    assert task.examples("train", 50, seed=0) == examples[:50]
    assert task.examples("eval", 50, seed=0) != examples[:50]
    assert task.max_response_len == max(TASKS[n](d).max_response_len for n, d in pairs)


def test_pretraining_trains_on_the_mixture_with_its_own_aux_coefficient(tmp_path, monkeypatch):
    """pretrain_steps=3 runs 3 pretraining losses on prompts of every family with aux_coef =
    pretrain_aux_loss_coef (model.router_aux_loss_coef is 0), then the band search; warmstart.json records it."""
    seen = []
    loss = pretrain_mod.demonstration_loss

    def spy(model, ids, mask, labels, aux_coef=None):
        seen.append((aux_coef, ids.clone()))
        return loss(model, ids, mask, labels, aux_coef=aux_coef)

    monkeypatch.setattr(pretrain_mod, "demonstration_loss", spy)
    cfg = WarmStartConfig(**{**FAST, "batch_size": 16}, pretrain_steps=3, pretrain_aux_loss_coef=0.05,
                          cache_dir=str(tmp_path))
    result = warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False)
    assert [c for c, _ in seen] == [0.05, 0.05, 0.05]
    tokenizer = AutoTokenizer.from_pretrained(result.path)
    text = [t for _, ids in seen for t in tokenizer.batch_decode(ids)]
    assert all(any(s in t for t in text) for s in ("sort ", "reach ", "="))
    meta = json.loads((Path(result.path) / "warmstart.json").read_text())
    assert meta["pretrain_steps"] == 3 and [h["step"] for h in meta["pretrain_history"]] == [1, 2, 3]  # eval_every=1
    assert meta["warmstart"]["pretrain_steps"] == 3 and meta["steps"] == result.steps


def test_pretrained_warm_start_is_deterministic_and_differs_from_task_only(tmp_path):
    """Two builds of one pretraining config give bitwise-equal weights; without pretraining the weights differ."""
    cfg = WarmStartConfig(**{**FAST, "batch_size": 8}, pretrain_steps=2)
    a, b = (warm_start(TINY, "arithmetic", 1, replace(cfg, cache_dir=str(tmp_path / d)), seed=0,
                       progress=False).path for d in "ab")
    plain = warm_start(TINY, "arithmetic", 1, replace(cfg, pretrain_steps=0, cache_dir=str(tmp_path / "c")),
                       seed=0, progress=False).path
    wa, wb, wp = weights_of(a), weights_of(b), weights_of(plain)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wp[k]) for k in wa)


def test_pretrain_stream_is_fixed_by_the_seed_and_apart_from_the_band_search():
    """The pretraining RNG of a seed repeats exactly and differs from another seed's and from the train split's."""
    draws = lambda rng: [rng.random() for _ in range(5)]  # noqa: E731
    assert draws(pretrain_mod.pretrain_stream(0)) == draws(pretrain_mod.pretrain_stream(0))
    assert draws(pretrain_mod.pretrain_stream(0)) != draws(pretrain_mod.pretrain_stream(1))
    assert draws(pretrain_mod.pretrain_stream(0)) != draws(random.Random(0))


def test_fine128_preset_has_128_experts_top8_and_fines_active_compute():
    """model=fine128 composes to 128 experts, top-8, with top_k x expert_ffn_size equal to fine's (and tiny's)."""
    from tests.integration.test_train_loop import compose_config

    fine128, fine, tiny = (compose_config([f"model={m}"]).model for m in ("fine128", "fine", "tiny"))
    assert (fine128.num_experts, fine128.top_k) == (128, 8)
    assert fine128.top_k * fine128.expert_ffn_size == fine.top_k * fine.expert_ffn_size == tiny.top_k * tiny.expert_ffn_size
    assert (fine128.num_layers, fine128.hidden_size) == (tiny.num_layers, tiny.hidden_size)


def test_every_point_of_the_routers_sweep_composes():
    """Each point of experiment=routers' sweep composes and validates; its pretraining arm turns pretraining on."""
    import itertools

    from omegaconf import OmegaConf

    from tests.integration.test_train_loop import CONF_DIR, compose_config

    params = OmegaConf.load(Path(CONF_DIR) / "experiment" / "routers.yaml").hydra.sweeper.params
    axes = [[f"{k}={v}" for v in str(vals).split(",")] for k, vals in params.items()]
    for point in itertools.product(*axes):
        cfg = compose_config(["+experiment=routers", *point])
        assert cfg.experiment == "routers" and cfg.objective.name == "grpo"
    cfg = compose_config(["+experiment=routers", "warmstart.pretrain_steps=200"])
    assert (cfg.warmstart.pretrain_steps, cfg.warmstart.pretrain_aux_loss_coef) == (200, 0.01)


def test_pretraining_without_the_warm_start_is_refused():
    """warmstart.pretrain_steps > 0 with warmstart.enabled=false raises ValueError naming both (never silently ignored)."""
    from tests.integration.test_train_loop import compose_config

    with pytest.raises(ValueError, match=r"warmstart\.pretrain_steps=5 needs warmstart\.enabled=true"):
        compose_config(["warmstart.enabled=false", "warmstart.pretrain_steps=5"])
    assert compose_config(["warmstart.enabled=false"]).warmstart.pretrain_steps == 0
