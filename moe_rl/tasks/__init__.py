"""Verifiable synthetic tasks: character-level prompts, 0/1 rewards and demonstration solvers.

Tasks: "arithmetic" (difficulty = operand digits, 1..6), "sort" (difficulty = item count, 2..32),
"countdown" (difficulty = how many numbers, 2..6). Build one with `make_task(name, difficulty)`.
"""

from __future__ import annotations

from moe_rl.tasks.arithmetic import ArithmeticTask
from moe_rl.tasks.base import ALPHABET, SPLITS, Example, Task, split_seed
from moe_rl.tasks.countdown import CountdownTask
from moe_rl.tasks.sort import SortTask

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (ArithmeticTask, SortTask, CountdownTask)}
"""Registry of task classes by `Task.name`."""


def make_task(name: str, difficulty: int) -> Task:
    """Build the task called `name` at `difficulty`; ValueError naming `task.name` / `task.difficulty`."""
    if name not in TASKS:
        raise ValueError(f"task.name must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name](difficulty)


__all__ = [
    "ALPHABET",
    "SPLITS",
    "TASKS",
    "ArithmeticTask",
    "CountdownTask",
    "Example",
    "SortTask",
    "Task",
    "make_task",
    "split_seed",
]
