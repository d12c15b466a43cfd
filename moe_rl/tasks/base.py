"""Shared pieces of every verifiable task: the character set, the example record and the `Task` base.

A task turns a seeded RNG into `Example`s, scores a model's response with a 0/1 reward, and writes a
demonstration response that scores 1. Rewards are binary on purpose so that mean reward equals accuracy.

Seeding: `Task.examples(split, n, seed)` draws from `random.Random(split_seed(split, seed))`, where
`split_seed` maps train to `2 * seed` and eval to `2 * seed + 1`. The two splits therefore never share an
RNG seed for any pair of seeds. Seeds must be non-negative because `random.Random` seeds with `abs(seed)`,
which would make seed `-s` replay seed `s`.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass
from typing import ClassVar

ALPHABET: str = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=()<>:,;?."
"""Every character a task prompt or solver response may contain (a char tokenizer is built from it)."""

SPLITS: tuple[str, ...] = ("train", "eval")
"""Valid `split` values; the index is the offset added to `2 * seed`."""


@dataclass(frozen=True)
class Example:
    """One task instance.

    prompt: the text the model is conditioned on, e.g. "12+345=".
    target: the reference answer the reward compares against, e.g. "357".
    data: task-specific hashable payload (documented in each task module), e.g. the operands.
    """

    prompt: str
    target: str
    data: tuple


def split_seed(split: str, seed: int) -> int:
    """Return the RNG seed of `split`: `2 * seed` for train, `2 * seed + 1` for eval (disjoint sets)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return 2 * seed + SPLITS.index(split)


class Task(abc.ABC):
    """A verifiable task family at one difficulty.

    Subclasses set `name`, `min_difficulty`, `max_difficulty` and implement `sample`, `is_correct`,
    `solve`, `max_response_len` and `difficulty_of`. `is_correct` must return False, never raise, on any
    string.
    """

    name: ClassVar[str]
    min_difficulty: ClassVar[int]
    max_difficulty: ClassVar[int]
    reward_can_fail: ClassVar[bool] = False
    """Whether `rewards` can report a failed row (a dataset's reward function); synthetic verifiers
    cannot fail, so their runs log no `rollout/reward_errors`."""

    def __init__(self, difficulty: int) -> None:
        lo, hi = self.min_difficulty, self.max_difficulty
        if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not lo <= difficulty <= hi:
            raise ValueError(
                f"task.difficulty must be an integer in [{lo}, {hi}] for task {self.name!r}, "
                f"got {difficulty!r}"
            )
        self.difficulty = difficulty

    def __repr__(self) -> str:
        return f"{type(self).__name__}(difficulty={self.difficulty})"

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> Example:
        """Draw one example using only `rng` for randomness."""

    @abc.abstractmethod
    def is_correct(self, example: Example, response: str) -> bool:
        """Whether `response` solves `example`; False (never an exception) for malformed text."""

    @abc.abstractmethod
    def solve(self, example: Example) -> str:
        """Write a demonstration response whose reward is 1.0."""

    @property
    @abc.abstractmethod
    def max_response_len(self) -> int:
        """Upper bound on the characters of a `solve` response at this difficulty."""

    @abc.abstractmethod
    def difficulty_of(self, example: Example) -> int:
        """The difficulty `example` was drawn at, read from its `data` (task.mix draws several)."""

    def reward(self, example: Example, response: str) -> float:
        """Return 1.0 if `response` solves `example`, else 0.0 (binary, so mean reward = accuracy)."""
        return 1.0 if self.is_correct(example, response) else 0.0

    def rewards(self, examples: list[Example], responses: list[str]) -> tuple[list[float], list[bool]]:
        """Each response's reward, and whether scoring it failed (never, for a synthetic task)."""
        return [self.reward(ex, r) for ex, r in zip(examples, responses, strict=True)], [False] * len(examples)

    @property
    def alphabet(self) -> str:
        """Every character a prompt or demonstration may contain: a character tokenizer's vocabulary."""
        return ALPHABET

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """Return `n` examples of `split` ("train"/"eval") from `random.Random(split_seed(split, seed))`."""
        if n < 0:
            raise ValueError(f"n must be non-negative, got {n}")
        rng = random.Random(split_seed(split, seed))
        return [self.sample(rng) for _ in range(n)]
