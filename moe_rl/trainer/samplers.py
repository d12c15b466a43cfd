"""The `Sampler` seam of an RL step: what draws and scores the step's rollouts, and takes the trained
weights after it. Three implementations; the step holds one and never asks which:

| sampler | samples with | `sync(model)` |
|---|---|---|
| `PolicySampler` | the trained model itself | nothing to do: None |
| `CopySampler` | a copy of the policy at trainer.sampler_dtype | loads the weights, cast: seconds |
| `VllmSampler` | the vLLM engine (sampler.engine=vllm) | the engine's weight reload: seconds |

Each of them samples stale when wrapped by moe_rl/trainer/stale.py (rollout.staleness > 0).

Every sampler draws the same prompts: step t's are the task's train examples for seed (seed·1_000_003 +
t), each repeated for its group of G completions, and this rank samples only its contiguous share of the
P x G rows (`Shard`), so a group's completions stay on one rank. Shape legend as in step.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moe_rl.rollout import Rollout, sample
from moe_rl.rollout.config import SamplerConfig
from moe_rl.rollout.vllm_engine import VllmEngine
from moe_rl.routing import RoutingController
from moe_rl.tasks import Example, Task


@dataclass(frozen=True)
class Shard:
    """This process's share of a step's rows: rank `rank` of `world` holds the rank-th contiguous slice."""

    rank: int = 0
    world: int = 1

    def rows(self, n: int) -> slice:
        share = n // self.world
        return slice(self.rank * share, (self.rank + 1) * share)


@dataclass(frozen=True)
class Scores:
    """A rollout's scores, this rank's rows: `rewards_B` (float32) and `failed_B` (float64, 1 where the
    task's reward failed and scored 0: a dataset's reward function)."""

    rewards_B: torch.Tensor
    failed_B: torch.Tensor


@dataclass(frozen=True)
class Draws:
    """Which prompts step t samples (module docstring), as each sampler shares them."""

    seed: int
    prompts_per_step: int
    group_size: int
    prompt: Callable[[str], str]
    """A task prompt as the model sees it (plain, or one user turn of the chat template)."""

    def step_seed(self, step: int) -> int:
        return self.seed * 1_000_003 + step

    def prompts(self, task: Task, step: int, shard: Shard) -> tuple[list[Example], list[str], slice]:
        """The step's P x G examples and prompts (grouped: each prompt G times), and this rank's rows."""
        examples = task.examples("train", self.prompts_per_step, seed=self.step_seed(step))
        examples_B = [ex for ex in examples for _ in range(self.group_size)]
        prompts = [self.prompt(ex.prompt) for ex in examples]
        grouped = [prompt for prompt in prompts for _ in range(self.group_size)]
        return examples_B, grouped, shard.rows(len(examples_B))


def score(task: Task, examples_B: list[Example], roll: Rollout) -> Scores:
    """The task's rewards of the sampled texts (this rank's rows)."""
    rewards, failed = task.rewards(examples_B, roll.texts)
    return Scores(torch.tensor(rewards, dtype=torch.float32), torch.tensor(failed, dtype=torch.float64))


class Sampler(Protocol):
    """Draws and scores a step's rollouts (`rollout`), and takes the trained weights after it (`sync`)."""

    exact: bool
    """Its log-probs are the trained model's own (the policy itself, current weights): no sampler mismatch
    is possible, so the step logs no mismatch diagnostics (`rollout_is/ess`, `rollout_is/chi2`)."""

    def rollout(self, task: Task, step: int, shard: Shard) -> tuple[Rollout, Scores]:
        """This rank's rows of step `step`'s P x G completions, and their scores."""
        ...

    def sync(self, model: PreTrainedModel) -> float | None:
        """Take `model`'s current weights; the seconds it took, or None when there is nothing to copy."""
        ...

    def verify(self, model: PreTrainedModel, controller: RoutingController, probe: str, probe_ids: torch.Tensor) -> None:
        """Fail at start-up, in one line, where this sampler cannot compute the trained model's function."""
        ...

    def state_dict(self) -> dict:
        """What a checkpoint must hold to resume this sampler exactly (rollouts sampled ahead: stale.py)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        ...

    def close(self) -> None:
        """Stop whatever the sampler runs beside the trainer (stale.py's background thread)."""
        ...


class Stateless:
    """A sampler that keeps nothing between steps: an empty checkpoint entry and nothing to stop."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class PolicySampler(Stateless):
    """Samples with `model` (the trained model itself) under `controller`'s recording."""

    draws: Draws
    model: PreTrainedModel
    controller: RoutingController
    tokenizer: PreTrainedTokenizerBase
    config: SamplerConfig
    generator: torch.Generator
    """Re-seeded from (seed, step) every step: ranks stop decoding when their own rows end, so the number
    of draws so far differs between ranks, and must not decide later steps' noise."""
    record_logits: bool = False
    """Record router logits too (trainer.reuse_sampler_logp: the sampler's trace is then the old policy's)."""
    record_gates: bool = False
    """Record the gates too (routing.replay_gates under R3: the update forwards combine with them)."""
    all_done: Callable[[bool], bool] | None = None
    """Under FSDP every forward is a collective: ranks stop decoding together (Dist.all_done)."""
    topk: int = 0
    """Record each position's top-k tokens and log-probs (the DPPO top-k divergences); 0 = none."""
    exact: bool = True
    """It samples with the trained model itself (`Sampler.exact`)."""

    def rollout(self, task: Task, step: int, shard: Shard) -> tuple[Rollout, Scores]:
        examples_B, grouped, rows = self.draws.prompts(task, step, shard)
        self.model.eval()
        self.generator.manual_seed(self.draws.step_seed(step))
        roll = sample(
            self.model,
            self.tokenizer,
            grouped,
            self.config,
            generator=self.generator,
            controller=self.controller,
            rows=rows,
            all_done=self.all_done,
            record_logits=self.record_logits,
            record_gates=self.record_gates,
            topk=self.topk,
        )
        return roll, score(task, examples_B[rows], roll)

    def sync(self, model: PreTrainedModel) -> float | None:
        return None

    def verify(self, model: PreTrainedModel, controller: RoutingController, probe: str, probe_ids: torch.Tensor) -> None:
        pass  # it is the trained model, whose gates start-up has checked


@dataclass
class CopySampler(PolicySampler):
    """Samples with a copy of the policy at another precision (trainer.sampler_dtype), with its own
    routing controller; `sync` loads the trained weights, cast to its dtype."""

    exact: bool = False

    def sync(self, model: PreTrainedModel) -> float:
        started = time.perf_counter()
        self.model.load_state_dict(model.state_dict())
        return time.perf_counter() - started

    def verify(self, model: PreTrainedModel, controller: RoutingController, probe: str, probe_ids: torch.Tensor) -> None:
        self.controller.verify_gates(self.model, probe_ids)


@dataclass
class VllmSampler(Stateless):
    """Samples with the vLLM engine (sampler.engine=vllm; moe_rl.rollout.vllm_engine)."""

    draws: Draws
    engine: VllmEngine
    exact = False  # another engine's kernels: its log-probs differ from the trained model's

    def rollout(self, task: Task, step: int, shard: Shard) -> tuple[Rollout, Scores]:
        examples_B, grouped, rows = self.draws.prompts(task, step, shard)
        tp = self.engine.cfg.tensor_parallel_size
        if tp == 1:
            roll = self.engine.sample(grouped, seed=self.draws.step_seed(step), rows=rows)
        else:  # the engine spans this rank's group of tp ranks: it samples all their rows, this rank keeps its own
            group = Shard(shard.rank // tp, shard.world // tp).rows(len(grouped))
            roll = self.engine.sample(grouped, seed=self.draws.step_seed(step), rows=group)
            roll = roll.rows(slice(rows.start - group.start, rows.stop - group.start))
        return roll, score(task, examples_B[rows], roll)

    def sync(self, model: PreTrainedModel) -> float:
        return self.engine.sync(model)

    def close(self) -> None:
        self.engine.close()

    def verify(self, model: PreTrainedModel, controller: RoutingController, probe: str, probe_ids: torch.Tensor) -> None:
        self.engine.verify(model, controller, [probe] * 2)  # the engine computes the model's function (fp32)


def chat_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    """`text` as one user turn of the tokenizer's chat template, ending where the assistant's answer starts.

    A BOS the template writes is dropped when the tokenizer adds its own, so it is not doubled.
    """
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    bos = tokenizer.bos_token
    if bos and chat.startswith(bos) and tokenizer("").input_ids[:1] == [tokenizer.bos_token_id]:
        chat = chat[len(bos) :]
    return chat
