"""Multi-digit addition and subtraction with an exact integer answer.

Difficulty d (1..6) is the number of digits of both operands (d = 1 draws 0..9).
Prompt:   "<a><op><b>=" with op in {+, -}, e.g. "12+345=" or "40-512=".
Response: the exact result in decimal, e.g. "357" or "-472"; surrounding spaces are ignored and
          leading zeros are accepted ("0357" parses as 357), anything else scores 0.
data:     (a, op, b), e.g. (12, "+", 345).
"""

from __future__ import annotations

import random
import re

from moe_rl.tasks.base import Example, Task

_INTEGER = re.compile(r"-?[0-9]+")


def _canonical_integer(text: str) -> str:
    """Return the canonical decimal form of a string matching `_INTEGER` ("-007" -> "-7", "-0" -> "0")."""
    # String normalisation instead of int(): int() refuses strings over 4300 digits.
    digits = text.lstrip("-").lstrip("0") or "0"
    negative = text.startswith("-") and digits != "0"
    return "-" + digits if negative else digits


class ArithmeticTask(Task):
    """a + b or a - b with d-digit operands; the answer must be the exact integer."""

    name = "arithmetic"
    min_difficulty = 1
    max_difficulty = 6

    def sample(self, rng: random.Random) -> Example:
        """Draw two d-digit operands and an operator uniformly."""
        lo = 0 if self.difficulty == 1 else 10 ** (self.difficulty - 1)
        hi = 10**self.difficulty - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        op = rng.choice("+-")
        value = a + b if op == "+" else a - b
        return Example(prompt=f"{a}{op}{b}=", target=str(value), data=(a, op, b))

    def is_correct(self, example: Example, response: str) -> bool:
        """Whether the space-stripped response is a decimal integer equal to the target."""
        text = response.strip(" ")
        return _INTEGER.fullmatch(text) is not None and _canonical_integer(text) == example.target

    def solve(self, example: Example) -> str:
        """Return the exact result."""
        return example.target

    def difficulty_of(self, example: Example) -> int:
        """d, the digits of the first operand (d = 1 draws 0..9, d > 1 exactly d digits)."""
        return len(str(example.data[0]))

    @property
    def max_response_len(self) -> int:
        """d + 1: a sum carries into one extra digit; a difference has at most d digits and a sign."""
        return self.difficulty + 1
