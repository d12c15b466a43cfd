"""The trained policy in Hugging Face format: `policy/` in the run folder.

`policy/` holds what `save_pretrained` writes for the model (config.json, generation_config.json,
model.safetensors) and the tokenizer, plus `moe_rl.json`: the run's config, the RL step the weights are
from and that step's metrics. Any `transformers` tool loads it (`AutoModelForCausalLM.from_pretrained`,
pipelines, lm-eval, vLLM for the families it supports), and `model.pretrained=<run>/policy` continues
training from it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

POLICY_DIR = "policy"
RUN_INFO = "moe_rl.json"


def export_policy(
    run_dir: Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    config: dict,
    step: int,
    metrics: dict[str, float],
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write run_dir/policy/ (model, tokenizer, moe_rl.json) and return its path.

    `step` counts the RL steps the weights have been trained for. `state_dict` overrides the model's own
    weights (under FSDP the model holds shards; pass the full state dict gathered for the checkpoint).
    The folder is written next to the old one and swapped in, so a crash mid-export never leaves a
    half-written policy/.
    """
    final = run_dir / POLICY_DIR
    tmp = run_dir / f".{POLICY_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    info = {
        "step": step,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)},
        "config": config,
    }
    (tmp / RUN_INFO).write_text(json.dumps(info, indent=2))
    old = run_dir / f".{POLICY_DIR}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final
