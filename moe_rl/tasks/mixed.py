"""One task family at several difficulties (`task.mix`): one policy sees several response lengths.

Each example's difficulty is drawn uniformly from the entries of `mix` with the example's own RNG, then
the example is drawn at that difficulty from the same RNG, so `Task.examples(split, n, seed)` stays a pure
function of its arguments (train and eval splits reproducible and disjoint as for one difficulty). A
repeated entry is drawn that much more often, and the order of the entries matters to the draws. Rewards,
demonstrations and the response bound are those of the example's own difficulty (`Task.difficulty_of`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from moe_rl.tasks.base import Example, Task


class MixedTask(Task):
    """`family` with each example at a difficulty drawn from `mix`; `difficulty` is validated, not drawn."""

    def __init__(self, family: type[Task], difficulty: int, mix: Sequence[int]) -> None:
        # The family's name and range, so the base class validates task.difficulty as the family would.
        self.name, self.min_difficulty, self.max_difficulty = (  # type: ignore[misc]
            family.name, family.min_difficulty, family.max_difficulty
        )
        super().__init__(difficulty)
        lo, hi = family.min_difficulty, family.max_difficulty
        bad = [d for d in mix if isinstance(d, bool) or not isinstance(d, int) or not lo <= d <= hi]
        if not mix or bad:
            raise ValueError(
                f"task.mix={list(mix)}: every entry must be an integer in [{lo}, {hi}] for task "
                f"{family.name!r}" + (f", got {bad}" if bad else " (an empty list turns the mix off)")
            )
        self.mix = tuple(mix)
        self.tasks = {d: family(d) for d in sorted(set(self.mix))}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, mix={list(self.mix)})"

    def sample(self, rng: random.Random) -> Example:
        """Draw the difficulty, then the example at it, both from `rng`."""
        return self.tasks[rng.choice(self.mix)].sample(rng)

    def is_correct(self, example: Example, response: str) -> bool:
        """The example's own difficulty decides."""
        return self.tasks[self.difficulty_of(example)].is_correct(example, response)

    def solve(self, example: Example) -> str:
        """The demonstration at the example's own difficulty."""
        return self.tasks[self.difficulty_of(example)].solve(example)

    def difficulty_of(self, example: Example) -> int:
        """The family's reading of the example's difficulty (one of `mix`)."""
        return next(iter(self.tasks.values())).difficulty_of(example)

    @property
    def max_response_len(self) -> int:
        """The longest bound over the mix."""
        return max(task.max_response_len for task in self.tasks.values())
