"""Held-out evaluation during RL: the policy on a fixed set of the task's eval prompts.

Every run with the same task, difficulty and `eval.seed` evaluates the same prompts (the eval split
never meets the train split: moe_rl.tasks.base): the first `eval.size` of the eval stream are sampled,
the first `eval.expected_size` are scored teacher-forced and greedily (both sets are prefixes of one
stream, so the smaller lies inside the larger). Sampling noise is freshly seeded at every evaluation, so
a change between evaluations reflects the weights, not the draw. Evaluation uses its own generator and
touches no training RNG, so turning it on or off never changes the training run. With `eval.at_start`
the policy is also evaluated before the first update, logged in step 0's row as `eval/initial/*`. A run
holds one `Evaluator`: `due(step, last)` on the schedule, `run()` the metrics, `initial()` before the
first update.
For task=dataset the eval stream is the dataset's held-out rows in a seeded order (moe_rl.tasks.dataset),
so `eval.size` and `eval.expected_size` may not exceed them, and "correct" means reward 1.

| key | meaning |
|---|---|
| `eval/accuracy` | fraction of the `eval.size` prompts answered correctly, one response each sampled as in RL (sampler.*) |
| `eval/response_len` | mean response tokens (EOS included) of those sampled responses |
| `eval/expected_accuracy` | over the `eval.expected_size` prompts, the mean of π(y* \\| x) = exp Σ_t log π(y*_t \\| x, y*_<t): the teacher-forced probability of the canonical answer y* (`task.solve` tokens, then EOS, as the sampler ends a response; `warmstart.answer_ids`) under softmax(logits / T) at the sampler's temperature T (1 when greedy), exactly as the RL log-probs (moe_rl.rollout.forward); 0 for an answer longer than `sampler.max_new_tokens`. No sampling noise. See below for when it equals the expected sampled accuracy |
| `eval/expected_accuracy/se` | its standard error over the eval prompts, sd of π(y* \\| x) / sqrt(`eval.expected_size`): the noise scale of the `eval_regression` collapse test |
| `eval/accuracy_greedy` | fraction of the `eval.expected_size` prompts answered correctly by greedy decoding |
| `eval/initial/<name>` | each of the above, of the policy before the first update (step 0's row only, with `eval.at_start`) |
| `time/eval_s` | wall seconds of the evaluation(s) logged in the row |

What `eval/expected_accuracy` means. It is the probability that one sampled response is exactly y*,
under the untruncated softmax at temperature T. It equals the expected sampled accuracy E[`eval/accuracy`]
when (a) the sampler does not truncate (`sampler.top_p=1`; with top_p < 1 the sampler draws from a
renormalised nucleus, so the two differ) and (b) y* is the only response the verifier accepts. For
arithmetic, sort and sort_long it is the only one up to the verifiers' tolerance of padding (surrounding
or repeated spaces, arithmetic's leading zeros), forms a policy warm-started on canonical demonstrations
all but never writes (tests/unit/trainer/test_heldout_evaluation.py checks the equality by Monte Carlo). With a subword tokenizer
y* is one tokenisation of the answer text; others decode to the same text. For countdown many
expressions reach the target, so it is a lower bound on the expected accuracy: the probability of
writing the generator's own expression.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moe_rl.rollout import SamplerConfig, response_logprobs, sample
from moe_rl.tasks import DatasetTask, Example, Task
from moe_rl.trainer.config import EvalConfig
from moe_rl.warmstart import answer_ids


@torch.no_grad()
def answer_logprobs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    prompts: list[str],
    examples: list[Example],
    temperature: float,
    max_new_tokens: int,
) -> torch.Tensor:
    """`[B]` float64 Σ_t log π(y*_t | x, y*_<t) of each example's canonical answer (`answer_ids`) at
    `temperature`, in one teacher-forced forward laid out as a rollout (left-padded prompts, right-padded
    responses: moe_rl.rollout.forward); -inf where the answer has more than `max_new_tokens` tokens."""
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    answers = [answer_ids(tokenizer, task, ex) for ex in examples]
    R = max(len(a) for a in answers)
    response_BR = torch.full((len(answers), R), tokenizer.pad_token_id, dtype=torch.long)
    mask_BR = torch.zeros(len(answers), R, dtype=torch.bool)
    for i, ids in enumerate(answers):
        response_BR[i, : len(ids)] = torch.tensor(ids)
        mask_BR[i, : len(ids)] = True
    ids_BS = torch.cat([enc["input_ids"], response_BR], 1).to(device)
    attn_BS = torch.cat([enc["attention_mask"], torch.ones_like(response_BR)], 1).to(device)
    logp_BR = response_logprobs(model, ids_BS, attn_BS, R, temperature).double().cpu()
    logp_B = logp_BR.masked_fill(~mask_BR, 0.0).sum(1)
    return logp_B.masked_fill(mask_BR.sum(1) > max_new_tokens, -torch.inf)


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@torch.no_grad()
def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    prompts: list[str],
    examples: list[Example],
    sampler_cfg: SamplerConfig,
    eval_cfg: EvalConfig,
) -> dict[str, float]:
    """`eval/*` metrics of `model` on `examples` (the first `eval_cfg.prompts_needed` of the eval stream,
    whose prompts, as the model sees them, are `prompts`)."""
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = {}
    try:
        if eval_cfg.size > 0:
            n = slice(eval_cfg.size)
            gen = torch.Generator(device).manual_seed(eval_cfg.seed)
            roll = sample(model, tokenizer, prompts[n], sampler_cfg, generator=gen)
            out["eval/accuracy"] = _accuracy(task, examples[n], roll.texts)
            out["eval/response_len"] = roll.response_mask_BR.sum(1).double().mean().item()
        if eval_cfg.expected_size > 0:
            greedy_cfg = dataclasses.replace(sampler_cfg, temperature=0.0)
            logp, texts = [], []
            for c in _chunks(eval_cfg.expected_size, eval_cfg.batch_size):
                logp.append(answer_logprobs(model, tokenizer, task, prompts[c], examples[c],
                                            sampler_cfg.temperature or 1.0, sampler_cfg.max_new_tokens))
                gen = torch.Generator(device).manual_seed(eval_cfg.seed)  # unused by greedy decoding
                texts += sample(model, tokenizer, prompts[c], greedy_cfg, generator=gen).texts
            prob_N = torch.cat(logp).exp()
            out["eval/expected_accuracy"] = prob_N.mean().item()
            # Its standard error over the eval prompts (sample sd / sqrt(N)): the noise scale of the
            # eval-regression test (moe_rl.trainer.collapse). NaN for one prompt.
            n = len(prob_N)
            out["eval/expected_accuracy/se"] = (prob_N.double().std() / n**0.5).item() if n > 1 else float("nan")
            out["eval/accuracy_greedy"] = _accuracy(task, examples[: eval_cfg.expected_size], texts)
    finally:
        model.train(was_training)
    out["time/eval_s"] = time.perf_counter() - t0
    return out


def _accuracy(task: Task, examples: list[Example], texts: list[str]) -> float:
    correct = [task.is_correct(ex, text) for ex, text in zip(examples, texts, strict=True)]
    return sum(correct) / len(correct)


def initial_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """`evaluate`'s metrics as logged for the policy before the first update: `eval/x` -> `eval/initial/x`."""
    return {k.replace("eval/", "eval/initial/", 1) if k.startswith("eval/") else k: v for k, v in metrics.items()}


class Evaluator:
    """The run's held-out evaluation: `due(step, last)` on the `eval.every` schedule (and at the run's last
    step), `run()` the `eval/*` metrics of the policy now, `initial()` before the first update. The eval
    prompts are drawn once, here; `prompt` turns a task prompt into what the model sees."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task,
                 prompt: Callable[[str], str], sampler_cfg: SamplerConfig, eval_cfg: EvalConfig) -> None:
        self.cfg = eval_cfg
        # A dataset with fewer held-out rows than eval asks for is evaluated on all of them (eval.fit_heldout).
        fitted = eval_cfg.fitted(len(task.heldout_rows)) if isinstance(task, DatasetTask) else eval_cfg
        examples = task.examples("eval", fitted.prompts_needed, fitted.seed)
        prompts = [prompt(ex.prompt) for ex in examples]
        self.evaluate = functools.partial(evaluate, model, tokenizer, task, prompts, examples, sampler_cfg, fitted)

    def due(self, step: int, last: bool) -> bool:
        """Whether to evaluate after RL step `step` (0-based); `last`: the run ends with it."""
        return self.cfg.due(step, last)

    def run(self) -> dict[str, float]:
        """`evaluate`'s metrics of the policy as it is now."""
        return self.evaluate()

    def initial(self) -> dict[str, float]:
        """The policy before the first update as `eval/initial/*` (with `eval.at_start`), else nothing."""
        return initial_metrics(self.run()) if self.cfg.enabled and self.cfg.at_start else {}
