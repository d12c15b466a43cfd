"""Shared test setup: offline W&B, deterministic small CPU runs."""

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "qwen2_moe")


@pytest.fixture(scope="session")
def tokenizer():
    """The default character tokenizer over the tasks' alphabet."""
    from moe_rl.models import build_tokenizer

    return build_tokenizer()


WARM = ["warmstart.target_low=0.1", "warmstart.target_high=0.9", "warmstart.eval_every=10", "warmstart.eval_size=64"]


@pytest.fixture(scope="session")
def warm_overrides(tmp_path_factory):
    """Hydra overrides under which the tiny test runs start from a warm start built once per session."""
    from test_train import TINY, compose_config

    from moe_rl.warmstart import warm_start

    overrides = [*WARM, f"warmstart.cache_dir={tmp_path_factory.mktemp('warmstart')}"]
    cfg = compose_config([*TINY, *overrides])
    warm_start(cfg.model, cfg.task.name, cfg.task.difficulty, cfg.warmstart, cfg.seed,
               max_new_tokens=cfg.sampler.max_new_tokens, progress=False)
    return overrides
