"""The long-response task preset (task=sort_long): at least 32 response tokens, and a reward that only the
exact sorted list earns."""

import random

import pytest

from moe_rl.tasks import make_task
from tests.integration.test_train_loop import compose_config


@pytest.fixture(scope="module")
def task():
    """The task the sort_long preset builds."""
    cfg = compose_config(["task=sort_long"])
    return make_task(cfg.task.name, cfg.task.difficulty)


def test_sort_long_responses_are_at_least_32_tokens(task, tokenizer):
    """Every sort_long demonstration, with its EOS, is at least 32 tokens of the character tokenizer, and the
    default sampler budget holds it."""
    cfg = compose_config(["task=sort_long"])
    for example in task.examples("train", 50, seed=3):
        ids = tokenizer(task.solve(example), add_special_tokens=False).input_ids
        assert len(ids) + 1 >= 32  # + EOS, which the policy samples like any other response token
        assert len(ids) + 1 <= cfg.sampler.max_new_tokens


def test_sort_long_rewards_correct_and_rejects_incorrect(task):
    """The sorted list (with any spacing) earns 1; one swapped, dropped, added or changed item earns 0."""
    example = task.examples("eval", 1, seed=0)[0]
    right = task.solve(example)
    assert task.reward(example, right) == 1.0
    assert task.reward(example, "  " + right.replace(" ", "   ") + " ") == 1.0
    items = right.split(" ")
    i = next(k for k in range(len(items) - 1) if items[k] != items[k + 1])
    swapped = items[:i] + [items[i + 1], items[i]] + items[i + 2 :]
    changed = items[:-1] + [str((int(items[-1]) + 1) % 10)]
    for wrong in (swapped, items[:-1], items + [items[-1]], changed, list(reversed(items))):
        assert task.reward(example, " ".join(wrong)) == 0.0, wrong
    assert task.reward(example, "".join(items)) == 0.0  # no separators: one token, not 16 items


def test_sort_long_reward_survives_hostile_answers(task):
    """Hostile or malformed responses (empty, prompt echo, huge, non-ASCII, signs, leading zeros, the answer
    with trailing junk) score 0 and never raise."""
    example = task.examples("eval", 1, seed=1)[0]
    right = task.solve(example)
    rng = random.Random(0)
    hostile = [
        "",
        " ",
        example.prompt,
        right * 3,
        right + " x",
        right + ":",
        "-" + right,
        right.replace(right[0], "0" + right[0], 1),
        "٣ " * 16,
        "\x00" * 40,
        " ".join(str(rng.randint(0, 9)) for _ in range(100_000)),
        "__import__('os').system('echo hi')",
    ]
    for answer in hostile:
        assert task.reward(example, answer) == 0.0, answer[:40]


def test_sort_long_examples_have_sixteen_items():
    """The preset is sort at 16 items: prompts list 16 digits, the target is their sorted order."""
    cfg = compose_config(["task=sort_long"])
    assert (cfg.task.name, cfg.task.difficulty) == ("sort", 16)
    for example in make_task("sort", 16).examples("train", 20, seed=0):
        assert len(example.data) == 16 and example.target == " ".join(map(str, sorted(example.data)))
        assert example.prompt == "sort " + " ".join(map(str, example.data)) + ":"
