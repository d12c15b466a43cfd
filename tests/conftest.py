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
