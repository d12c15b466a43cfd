"""Countdown: reach a target by combining given numbers with +, - and * and parentheses.

Difficulty k (2..6) is how many numbers are given; each may be used at most once (repeats in the
prompt may each be used once). Numbers are drawn from NUMBER_MIN..NUMBER_MAX; the target is the value of
a random expression over all k numbers, redrawn until it lies in 0..TARGET_MAX, so a solution exists.
Prompt:   "reach <target> with <numbers separated by spaces>:", e.g. "reach 150 with 3 7 12 2:".
Response: an expression such as "(3+7)*12+2*15"; only digits, + - * ( ) and spaces are allowed, no unary
          minus, no division or powers, at most MAX_EXPRESSION_CHARS characters.
data:     (numbers, solution): the numbers in prompt order and the generating expression.

Responses are checked with `ast.parse` and a whitelist of node types, never evaluated as Python.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections import Counter
from collections.abc import Callable

from moe_rl.tasks.base import Example, Task

NUMBER_MIN, NUMBER_MAX = 1, 12
TARGET_MAX = 999
MAX_EXPRESSION_CHARS = 200

_EXPRESSION_CHARS = re.compile(r"[0-9+\-*() ]+")
_OPERATORS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}
_SYMBOLS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _evaluate_node(node: ast.AST, used: list[int]) -> int | None:
    """Evaluate a whitelisted AST (int constants, binary + - *), recording constants; None otherwise."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _evaluate_node(node.left, used)
        right = _evaluate_node(node.right, used)
        if left is None or right is None:
            return None
        return _OPERATORS[type(node.op)](left, right)
    return None


def evaluate_expression(text: str, numbers: tuple[int, ...]) -> int | None:
    """Value of `text` if it is a valid expression using each of `numbers` at most once, else None."""
    # The character filter runs first, so ast.parse only ever sees short, ASCII, arithmetic-only text.
    if len(text) > MAX_EXPRESSION_CHARS or _EXPRESSION_CHARS.fullmatch(text) is None:
        return None
    try:
        tree = ast.parse(text.strip(" "), mode="eval")
    except SyntaxError:  # includes leading zeros ("012") and too-deep nesting
        return None
    used: list[int] = []
    value = _evaluate_node(tree.body, used)
    if value is None or Counter(used) - Counter(numbers):
        return None
    return value


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, int]:
    """A random binary expression tree over `numbers` in order, as (text, value); subtrees parenthesised."""
    if len(numbers) == 1:
        return str(numbers[0]), numbers[0]
    split = rng.randint(1, len(numbers) - 1)
    left_text, left_value = _random_expression(rng, numbers[:split])
    right_text, right_value = _random_expression(rng, numbers[split:])
    symbol = rng.choice("+-*")
    left_text = left_text if split == 1 else f"({left_text})"
    right_text = right_text if len(numbers) - split == 1 else f"({right_text})"
    return f"{left_text}{symbol}{right_text}", _SYMBOLS[symbol](left_value, right_value)


class CountdownTask(Task):
    """Combine k given numbers with + - * to hit the target; reward 1 iff valid and equal."""

    name = "countdown"
    min_difficulty = 2
    max_difficulty = 6

    def sample(self, rng: random.Random) -> Example:
        """Draw k numbers and a random expression over them until its value lies in 0..TARGET_MAX."""
        while True:
            numbers = [rng.randint(NUMBER_MIN, NUMBER_MAX) for _ in range(self.difficulty)]
            # Shuffle the expression order so the prompt order does not give the solution away.
            text, value = _random_expression(rng, rng.sample(numbers, len(numbers)))
            if 0 <= value <= TARGET_MAX:
                break
        prompt = f"reach {value} with " + " ".join(map(str, numbers)) + ":"
        return Example(prompt=prompt, target=str(value), data=(tuple(numbers), text))

    def is_correct(self, example: Example, response: str) -> bool:
        """Whether the response is a valid expression over the given numbers whose value is the target."""
        numbers, _ = example.data
        value = evaluate_expression(response, numbers)
        return value is not None and str(value) == example.target

    def solve(self, example: Example) -> str:
        """Return the generating expression."""
        return example.data[1]

    def difficulty_of(self, example: Example) -> int:
        """k, how many numbers are given."""
        return len(example.data[0])

    @property
    def max_response_len(self) -> int:
        """k numbers, k - 1 operators and one pair of parentheses per non-root internal node (k - 2)."""
        k = self.difficulty
        return k * len(str(NUMBER_MAX)) + (k - 1) + 2 * (k - 2)
