"""A reward function that passes its first call (the start-up probe) and calls sys.exit(5) on its second
(tests/unit/tasks/test_dataset_task.py, issue 56)."""

import sys

calls = 0


def fn(prompt, response, example):
    global calls
    calls += 1
    if calls == 2:
        sys.exit(5)
    return 1.0
