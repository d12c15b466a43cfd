"""Every task family at every difficulty: the broad mixture a warm start can pretrain on.

Each example draws its family uniformly from `families` (by sorted name), then its difficulty uniformly
from the family's whole range [min_difficulty, max_difficulty], then the example at that difficulty, all
from the example's own RNG, so `Task.examples(split, n, seed)` stays a pure function of its arguments.
Prompt and target are the family's; `data` is `(family name, the family's data)`, so the family's own
reward, demonstration and difficulty reading apply. Families have distinct prompt formats ("12+3=",
"sort ...:", "reach ... with ...:"), so a policy can tell them apart.

Not a run task (it is not in `TASKS`): it exists so that `warmstart.pretrain_steps` trains the routers on
broad data before the run's task, as a pretrained MoE's were.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from moe_rl.tasks.base import Example, Task


class BroadTask(Task):
    """Uniform over families, then uniform over each family's difficulties (see module docstring)."""

    name = "broad"
    # The mixture has no difficulty knob: 1 is its only valid value.
    min_difficulty = 1
    max_difficulty = 1

    def __init__(self, families: Mapping[str, type[Task]]) -> None:
        super().__init__(1)
        if not families:
            raise ValueError("BroadTask needs at least one task family")
        self.names = sorted(families)
        self.tasks = {
            (name, d): families[name](d)
            for name in self.names
            for d in range(families[name].min_difficulty, families[name].max_difficulty + 1)
        }
        self.difficulties = {name: sorted(d for n, d in self.tasks if n == name) for name in self.names}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.names})"

    def sample(self, rng: random.Random) -> Example:
        """Draw the family, then its difficulty, then the example, all from `rng`."""
        name = rng.choice(self.names)
        inner = self.tasks[name, rng.choice(self.difficulties[name])].sample(rng)
        return Example(prompt=inner.prompt, target=inner.target, data=(name, inner.data))

    def _own(self, example: Example) -> tuple[Task, Example]:
        """The family task at the example's difficulty and the example as that family wrote it."""
        name, data = example.data
        inner = Example(prompt=example.prompt, target=example.target, data=data)
        any_task = self.tasks[name, self.difficulties[name][0]]
        return self.tasks[name, any_task.difficulty_of(inner)], inner

    def is_correct(self, example: Example, response: str) -> bool:
        """The example's own family and difficulty decide."""
        task, inner = self._own(example)
        return task.is_correct(inner, response)

    def solve(self, example: Example) -> str:
        """The family's demonstration at the example's difficulty."""
        task, inner = self._own(example)
        return task.solve(inner)

    def difficulty_of(self, example: Example) -> int:
        """The family's difficulty of the example (families' scales differ: see `family_of`)."""
        task, _ = self._own(example)
        return task.difficulty

    @staticmethod
    def family_of(example: Example) -> str:
        """The family the example was drawn from."""
        return example.data[0]

    @property
    def max_response_len(self) -> int:
        """The longest bound over every family and difficulty."""
        return max(task.max_response_len for task in self.tasks.values())
