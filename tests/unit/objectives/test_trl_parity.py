"""Cross-check against TRL: moe-rl's objectives equal `GRPOTrainer._compute_loss` on identical inputs.

A real `trl.GRPOTrainer` is built on moe-rl's tiny Qwen3-MoE and character tokenizer; its `_compute_loss`
runs unmodified on a hand-made batch (ragged completions, old log-probs off the current ones, sampler
log-probs off the old ones). moe-rl's objective gets the log-probs TRL's own forward computes, so loss and
parameter gradients must agree to float32 rounding. Slow only because importing TRL takes ~10 s.

What is and is not TRL's code: TRL computes the rollout IS weight while generating with vLLM, which cannot
run here, so `trl_is_weight` restates that step (grpo_trainer.py, `vllm_importance_sampling_mode`) and
the trainer's `use_vllm` flag is set so that `_compute_loss` applies the weight. Parameter mapping:
TRL cispo caps the ratio at epsilon_high itself (moe-rl clip_high = epsilon_high − 1, clip_low = 1); TRL's
truncate modes cap at clip_max with no floor, its mask modes keep [clip_min, clip_max] = [1/C, C].
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from moe_rl.models.build import build_model
from moe_rl.models.config import ModelConfig
from moe_rl.models.tokenizer import build_tokenizer
from moe_rl.objectives import OBJECTIVES

pytestmark = pytest.mark.slow
CAP = 1.5


def trl_trainer(tmp_path, loss_type: str, mode: str, level: str = "token", opsm: float | None = None):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = build_model(ModelConfig(), tok)
    epsilon_high = 5.0 if loss_type == "cispo" else 0.28
    args = GRPOConfig(
        output_dir=str(tmp_path),
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=epsilon_high,
        beta=0.0,
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        save_strategy="no",
        vllm_importance_sampling_mode=mode if mode != "none" else "sequence_mask",
        vllm_importance_sampling_clip_max=CAP,
        vllm_importance_sampling_clip_min=1 / CAP if mode.endswith("mask") else None,
        importance_sampling_level=level,
        off_policy_mask_threshold=opsm,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+2="] * 8}),
        processing_class=tok,
    )
    trainer.use_vllm = mode != "none"  # _compute_loss applies inputs["importance_sampling_ratio"] only then
    trainer.model.eval()  # TRL's eval mode: no gradient-accumulation normaliser
    return trainer


def trl_is_weight(old_BT, sampler_BT, mask_BT, mode):
    """TRL's vLLM IS weight, restated from _generate_and_score_completions (see the module docstring)."""
    diff_BT = (old_BT - sampler_BT) * mask_BT
    if mode.startswith("sequence"):
        diff_BT = diff_BT.sum(-1, keepdim=True)
    ratio = torch.exp(diff_BT)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, max=CAP)
    return ratio.masked_fill((ratio < 1 / CAP) | (ratio > CAP), 0.0)


@pytest.mark.parametrize(
    ("loss_type", "mode", "level", "opsm"),
    [
        *[(lt, m, "token", None) for lt, m in [("cispo", "none"), ("cispo", "token_truncate"),
          ("grpo", "token_truncate"), ("grpo", "token_mask"), ("grpo", "sequence_truncate"),
          ("grpo", "sequence_mask"), ("grpo", "none")]],
        ("sapo", "none", "token", None),  # issue 25: SAPO, token and sequence level
        ("sapo", "token_truncate", "sequence", None),
        ("grpo", "none", "token", 0.05),  # off-policy sequence masking (TRL off_policy_mask_threshold)
        ("sapo", "token_mask", "token", 0.05),
        ("vespo", "none", "token", None),  # issue 53: VESPO, its token corrections folded into log w
        ("vespo", "token_truncate", "token", None),
        ("vespo", "token_mask", "token", None),
        ("luspo", "none", "sequence", None),  # LUSPO at TRL's recommended sequence level
        ("luspo", "token_truncate", "sequence", None),
    ],
)
def test_loss_and_gradients_match_trl(tmp_path, loss_type, mode, level, opsm):
    """moe-rl's cispo/grpo/sapo/vespo/luspo with rollout_is=mode (and opsm_delta) equal TRL's loss_type with that IS
    mode, importance_sampling_level and off_policy_mask_threshold: value and gradients."""
    trainer = trl_trainer(tmp_path, loss_type, mode, level, opsm)
    model = trainer.model
    g = torch.Generator().manual_seed(1)
    B, P, R = 8, 4, 6
    prompt_ids = torch.randint(4, 20, (B, P), generator=g)
    completion_ids = torch.randint(4, 20, (B, R), generator=g)
    lengths = torch.tensor([6, 1, 3, 6, 5, 2, 4, 6])
    mask_BR = (torch.arange(R)[None] < lengths[:, None]).long()
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([torch.ones(B, P, dtype=torch.long), mask_BR], 1)
    with torch.no_grad():
        current_BR = trainer._get_per_token_logps_and_entropies(model, input_ids, attention, R)[0]
    old_BR = current_BR + 0.3 * torch.randn(B, R, generator=g)
    sampler_BR = old_BR + 0.4 * torch.randn(B, R, generator=g)
    adv_B = torch.randn(B, generator=g)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": mask_BR,
        "advantages": adv_B,
        "old_per_token_logps": old_BR,
        "num_items_in_batch": mask_BR.sum(),
    }
    if mode != "none":
        inputs["importance_sampling_ratio"] = trl_is_weight(old_BR, sampler_BR, mask_BR, mode)
    if opsm is not None:  # TRL's OPSM reads the sampler's log-probs when it has them (vLLM), else π_old's
        inputs["sampling_per_token_logps"] = sampler_BR if mode != "none" else old_BR

    params = [p for p in model.parameters() if p.requires_grad]
    trl_loss = trainer._compute_loss(model, inputs)
    trl_grads = torch.autograd.grad(trl_loss, params, allow_unused=True)

    logp_BR = trainer._get_per_token_logps_and_entropies(model, input_ids, attention, R)[0]
    clip = (
        {"clip_low": 1.0, "clip_high": 4.0} if loss_type == "cispo" else {"clip_low": 0.2, "clip_high": 0.28}
    )
    name = "sapo_seq" if (loss_type, level) == ("sapo", "sequence") else loss_type
    loss, metrics = OBJECTIVES[name](
        logp_BR,
        old_BR,
        adv_B,
        mask_BR.bool(),
        **clip,
        loss_agg="token-mean" if loss_type in ("cispo", "vespo") else "seq-mean-token-mean",
        sampler_logp=sampler_BR if mode != "none" or opsm is None else None,
        rollout_is=mode,
        rollout_is_cap=CAP,
        opsm_delta=opsm,
    )
    grads = torch.autograd.grad(loss, params, allow_unused=True)

    assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    assert sum(gr is not None for gr in grads) > 10
    for ours, theirs in zip(grads, trl_grads, strict=True):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
    if mode != "none":  # the correction is exercised: some weights are truncated or masked
        frac = metrics.get("rollout_is/clipped_frac", metrics.get("rollout_is/masked_frac"))
        assert 0 < frac < 1
    if opsm is not None:  # the mask is exercised: some sequences dropped, not all
        assert 0 < metrics["policy/opsm_masked_frac"] < 1
