"""Sort N single-digit numbers in ascending order.

Difficulty N (2..32) is the number of items; the response is exactly 2N - 1 characters long, so N is
the knob for response-length ablations.
Prompt:   "sort <items separated by spaces>:", e.g. "sort 5 3 9 1:".
Response: the items in ascending order separated by spaces, e.g. "1 3 5 9". Runs of spaces and
          surrounding spaces are ignored; anything else (missing, extra or reordered items) scores 0.
data:     the items in prompt order, e.g. (5, 3, 9, 1).
"""

from __future__ import annotations

import random

from moe_rl.tasks.base import Example, Task

ITEM_MAX = 9
"""Items are drawn uniformly from 0..ITEM_MAX (single digits, so repeats are common)."""


class SortTask(Task):
    """Sort N single-digit items; reward 1 only for exactly the sorted list."""

    name = "sort"
    min_difficulty = 2
    max_difficulty = 32

    def sample(self, rng: random.Random) -> Example:
        """Draw N items uniformly from 0..ITEM_MAX."""
        items = tuple(rng.randint(0, ITEM_MAX) for _ in range(self.difficulty))
        prompt = "sort " + " ".join(map(str, items)) + ":"
        target = " ".join(map(str, sorted(items)))
        return Example(prompt=prompt, target=target, data=items)

    def is_correct(self, example: Example, response: str) -> bool:
        """Whether the space-separated tokens of the response equal the sorted items."""
        tokens = [token for token in response.split(" ") if token]
        return tokens == example.target.split(" ")

    def solve(self, example: Example) -> str:
        """Return the sorted items."""
        return example.target

    def difficulty_of(self, example: Example) -> int:
        """N, the number of items."""
        return len(example.data)

    @property
    def max_response_len(self) -> int:
        """2N - 1: N single digits and N - 1 separating spaces."""
        return 2 * self.difficulty - 1
