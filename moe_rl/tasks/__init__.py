"""Verifiable synthetic tasks: character-level prompts, 0/1 rewards and demonstration solvers.

Tasks: "arithmetic" (difficulty = operand digits, 1..6), "sort" (difficulty = item count, 2..32),
"countdown" (difficulty = how many numbers, 2..6). Build one with `make_task(name, difficulty)`, or
with `make_task(name, difficulty, mix)` one whose examples are drawn at the difficulties in `mix`
(`MixedTask`, task.mix). `BroadTask(TASKS)` mixes every family at every difficulty (the warm start's
pretraining data, `warmstart.pretrain_steps`). `DatasetTask` (task=dataset) serves the rows of a file or
hub dataset, scored by a verifier or a reward function (moe_rl.tasks.dataset); `build_task(TaskConfig)`
builds whichever the config names.
"""

from __future__ import annotations

from moe_rl.tasks.arithmetic import ArithmeticTask
from moe_rl.tasks.base import ALPHABET, SPLITS, Example, Task, split_seed
from moe_rl.tasks.broad import BroadTask
from moe_rl.tasks.config import DATASET, TaskConfig
from moe_rl.tasks.countdown import CountdownTask
from moe_rl.tasks.dataset import DatasetTask
from moe_rl.tasks.mixed import MixedTask
from moe_rl.tasks.registry import TASKS, make_task
from moe_rl.tasks.sort import SortTask


def build_task(cfg: TaskConfig) -> Task:
    """The task `cfg` names: a synthetic one (`make_task`), or a `DatasetTask`, which loads its data and
    checks its fields, verifier and reward function; ValueError naming the field."""
    cfg.validate()
    if cfg.name == DATASET:
        return DatasetTask(cfg)
    return make_task(cfg.name, cfg.difficulty, cfg.mix)


__all__ = [
    "DATASET",
    "ALPHABET",
    "SPLITS",
    "TASKS",
    "ArithmeticTask",
    "BroadTask",
    "CountdownTask",
    "DatasetTask",
    "Example",
    "MixedTask",
    "SortTask",
    "Task",
    "TaskConfig",
    "build_task",
    "make_task",
    "split_seed",
]
