"""The registry of synthetic task classes and `make_task`: below `TaskConfig`, whose `validate` reads the
registry's names (and above every task class, which it lists)."""

from __future__ import annotations

from collections.abc import Sequence

from moe_rl.tasks.arithmetic import ArithmeticTask
from moe_rl.tasks.base import Task
from moe_rl.tasks.countdown import CountdownTask
from moe_rl.tasks.mixed import MixedTask
from moe_rl.tasks.sort import SortTask

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (ArithmeticTask, SortTask, CountdownTask)}
"""Registry of task classes by `Task.name`."""


def make_task(name: str, difficulty: int, mix: Sequence[int] = ()) -> Task:
    """Build the task called `name` at `difficulty`, or, when `mix` is non-empty, a `MixedTask` drawing
    each example's difficulty from `mix`; ValueError naming `task.name`, `task.difficulty` or `task.mix`."""
    if name not in TASKS:
        raise ValueError(f"task.name must be one of {sorted(TASKS)}, got {name!r}")
    if mix:
        return MixedTask(TASKS[name], difficulty, mix)
    return TASKS[name](difficulty)
