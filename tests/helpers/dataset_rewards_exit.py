"""A reward module that calls sys.exit(4) while it is imported (tests/unit/tasks/test_dataset_task.py)."""

import sys

sys.exit(4)


def fn(prompt, response, example):
    """Never reached."""
    return 1.0
