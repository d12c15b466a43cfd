"""Reward functions for tests/unit/tasks/test_dataset_task.py, imported by path as task.reward_fn=tests.helpers.dataset_rewards:<name>."""

import math
import sys

calls = 0


def last_digit_match(prompt, response, example):
    """1.0 when the response ends with the answer's last character, else 0.0 (a well-behaved reward)."""
    return float(bool(response) and response[-1] == example["answer"][-1])


def fussy(prompt, response, example):
    """1.0 for exactly the answer; raises on anything else (so every sampled response is an error)."""
    if response == example["answer"]:
        return 1.0
    raise ValueError("not the answer")


def flaky(prompt, response, example):
    """Raises on "boom", returns NaN on "nan", a string on "text", else 1.0 (one of each failure)."""
    if response == "boom":
        raise ZeroDivisionError("boom")
    if response == "nan":
        return math.nan
    if response == "text":
        return "1.0"
    return 1.0


def half(prompt, response, example):
    """0.5 for everything: the answers are never full marks, so no warm start can imitate them."""
    return 0.5


def always_raises(prompt, response, example):
    """Fails on every row, the probe included."""
    raise RuntimeError("reward server unreachable")


def returns_inf(prompt, response, example):
    """A non-finite reward on every row, the probe included."""
    return math.inf


NOT_A_FUNCTION = 3


def exits_on_wrong(prompt, response, example):
    """1.0 for exactly the answer (so the start-up probe passes); anything else calls sys.exit(3)."""
    if response == example["answer"]:
        return 1.0
    sys.exit(3)


def exits(prompt, response, example):
    """Calls sys.exit(3) on every row, the probe included."""
    sys.exit(3)


def interrupted_on_wrong(prompt, response, example):
    """1.0 for exactly the answer; raises KeyboardInterrupt on anything else."""
    if response == example["answer"]:
        return 1.0
    raise KeyboardInterrupt


def huge(prompt, response, example):
    """1e308, finite, but a group's mean of two overflows (issue 56's probe)."""
    return 1e308
