"""Held-out evaluation: the teacher-forced expected accuracy against a float64 reference and against sampling."""

import copy
import math

import numpy as np
import pytest
import torch

from moe_rl.config import EvalConfig
from moe_rl.models import ModelConfig, build_model
from moe_rl.rollout import SamplerConfig, sample
from moe_rl.tasks import make_task
from moe_rl.trainer.evaluate import answer_logprobs, evaluate, initial_metrics
from moe_rl.warmstart import answer_ids, demonstration_batch, demonstration_loss

SMALL = ModelConfig(num_layers=2)
EAGER = ModelConfig(num_layers=2, experts_impl="eager")  # grouped_mm has no float64 kernel


def _reference_logprob(model, tokenizer, task, example, temperature: float) -> float:
    """Σ_t log softmax(logits / T)[y*_t] in float64: one unpadded full forward per answer token."""
    model64 = copy.deepcopy(model).double()
    ids = tokenizer(example.prompt)["input_ids"]
    total = 0.0
    for tok in answer_ids(tokenizer, task, example):
        logits_V = model64(input_ids=torch.tensor([ids])).logits[0, -1]
        total += torch.log_softmax(logits_V / temperature, -1)[tok].item()
        ids = ids + [tok]
    return total


@pytest.mark.parametrize("task_name,difficulty", [("arithmetic", 2), ("sort", 3)])
def test_answer_logprobs_match_float64_reference(tokenizer, task_name, difficulty):
    """The batched, padded teacher-forced log-prob of each canonical answer (EOS included) at T = 0.7 equals
    a float64 token-by-token loop over the unpadded sequence."""
    torch.manual_seed(0)
    model = build_model(EAGER, tokenizer)
    task = make_task(task_name, difficulty)
    examples = task.examples("eval", 5, seed=3)
    got = answer_logprobs(model, tokenizer, task, [e.prompt for e in examples], examples, 0.7, 32)
    ref = torch.tensor([_reference_logprob(model, tokenizer, task, e, 0.7) for e in examples], dtype=torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-5)


def test_answer_longer_than_max_new_tokens_has_probability_zero(tokenizer):
    """An answer the sampler could not finish within sampler.max_new_tokens (EOS included) scores -inf log-prob."""
    model = build_model(SMALL, tokenizer)
    task = make_task("sort", 3)  # 5 characters + EOS = 6 tokens
    examples = task.examples("eval", 2, seed=0)
    prompts = [e.prompt for e in examples]
    assert torch.isfinite(answer_logprobs(model, tokenizer, task, prompts, examples, 1.0, 6)).all()
    assert torch.isneginf(answer_logprobs(model, tokenizer, task, prompts, examples, 1.0, 5)).all()


def _overfit(tokenizer, task, examples, steps: int):
    """A tiny model trained on these examples' demonstrations until their answers are likely, not certain."""
    torch.manual_seed(0)
    model = build_model(SMALL, tokenizer).train()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = demonstration_batch(tokenizer, task, examples)
    for _ in range(steps):
        optim.zero_grad()
        demonstration_loss(model, *batch).backward()
        optim.step()
    return model.eval()


@pytest.mark.parametrize(
    "task_name,difficulty,steps,temperature",
    [("arithmetic", 2, 8, 1.0), ("sort", 3, 16, 1.0), pytest.param("arithmetic", 2, 8, 0.8, marks=pytest.mark.slow)],
)
def test_expected_accuracy_equals_sampled_accuracy(tokenizer, task_name, difficulty, steps, temperature):
    """With top_p = 1, each prompt's π(y* | x) at the sampler's temperature equals the fraction of N = 1000
    sampled responses the verifier accepts, within 4.5 binomial standard errors, on arithmetic and sort (the
    verifiers' other accepted forms, padded or zero-led, get no visible mass from a policy trained on
    canonical answers)."""
    task = make_task(task_name, difficulty)
    examples = task.examples("train", 4, seed=1)
    model = _overfit(tokenizer, task, examples, steps=steps)
    prompts = [e.prompt for e in examples]
    p_B = answer_logprobs(model, tokenizer, task, prompts, examples, temperature, 8).exp()
    assert ((p_B > 0.05) & (p_B < 0.95)).sum() >= 2, p_B  # the check has power: not all 0 or 1
    n = 1000
    roll = sample(model, tokenizer, prompts * n, SamplerConfig(temperature=temperature, max_new_tokens=8),
                  generator=torch.Generator().manual_seed(0))
    correct = torch.tensor([task.is_correct(examples[i % 4], t) for i, t in enumerate(roll.texts)], dtype=torch.float64)
    rate_B = correct.view(n, 4).mean(0)
    se_B = (p_B * (1 - p_B) / n).sqrt().clamp_min(1e-3)
    assert ((rate_B - p_B).abs() < 4.5 * se_B).all(), (rate_B, p_B)


def test_evaluate_reports_every_key_and_is_independent_of_batch_size(tokenizer):
    """evaluate logs sampled accuracy on the first eval.size prompts, expected and greedy accuracy on the
    first eval.expected_size, and eval.batch_size changes no value."""
    task = make_task("arithmetic", 1)
    examples = task.examples("eval", 12, seed=0)
    model = _overfit(tokenizer, task, examples[:6], steps=15)
    prompts = [e.prompt for e in examples]
    sc = SamplerConfig(max_new_tokens=4)
    whole = evaluate(model, tokenizer, task, prompts, examples, sc, EvalConfig(size=5, expected_size=12, batch_size=64))
    split = evaluate(model, tokenizer, task, prompts, examples, sc, EvalConfig(size=5, expected_size=12, batch_size=5))
    assert set(whole) == {"eval/accuracy", "eval/response_len", "eval/expected_accuracy", "eval/expected_accuracy/se",
                          "eval/accuracy_greedy", "time/eval_s"}
    for key in ("eval/accuracy", "eval/response_len", "eval/accuracy_greedy"):
        assert whole[key] == split[key], key
    assert math.isclose(whole["eval/expected_accuracy"], split["eval/expected_accuracy"], rel_tol=1e-5)
    p_B = answer_logprobs(model, tokenizer, task, prompts, examples, 1.0, 4).exp()
    assert math.isclose(whole["eval/expected_accuracy"], p_B.mean().item(), rel_tol=1e-6)
    # its standard error over the 12 prompts, against float64 numpy (sample sd / sqrt(n))
    ref_se = np.asarray(p_B, dtype=np.float64).std(ddof=1) / np.sqrt(12)
    assert math.isclose(whole["eval/expected_accuracy/se"], ref_se, rel_tol=1e-5) and ref_se > 0
    assert 0 < whole["eval/expected_accuracy"] < 1
    only_sampled = evaluate(model, tokenizer, task, prompts, examples, sc, EvalConfig(size=5, expected_size=0))
    assert set(only_sampled) == {"eval/accuracy", "eval/response_len", "time/eval_s"}


def test_initial_metrics_rename_eval_keys_only():
    """The pre-update evaluation is logged as eval/initial/<name>; non-eval keys (its time) keep their names."""
    assert initial_metrics({"eval/expected_accuracy": 0.5, "time/eval_s": 1.0}) == {
        "eval/initial/expected_accuracy": 0.5, "time/eval_s": 1.0}


@pytest.mark.parametrize("field,value", [("expected_size", -1), ("batch_size", 0), ("size", -2)])
def test_eval_config_rejects_bad_values_naming_the_field(field, value):
    """A negative size or a batch size below 1 raises ValueError naming eval.<field>."""
    with pytest.raises(ValueError, match=f"eval.{field}="):
        EvalConfig(**{field: value}).validate()
