"""Contracts of the verifiable tasks in `moe_rl.tasks`: solvers, rewards, seeding and the registry."""

from __future__ import annotations

import random

import pytest

from moe_rl.tasks import ALPHABET, TASKS, Example, Task, make_task, split_seed
from moe_rl.tasks.countdown import MAX_EXPRESSION_CHARS, evaluate_expression

ALL_CASES = [
    (name, d) for name, cls in TASKS.items() for d in range(cls.min_difficulty, cls.max_difficulty + 1)
]
FEW_CASES = [
    ("arithmetic", 1),
    ("arithmetic", 6),
    ("sort", 2),
    ("sort", 32),
    ("countdown", 2),
    ("countdown", 6),
]

MALFORMED = [
    "",
    " ",
    "abc",
    "((",
    "))",
    "()",
    "1e999",
    "9" * 5000,
    "-" * 300,
    "(" * 150 + "1" + ")" * 150,
    "__import__('os')",
    "__import__('os').system('true')",
    "1/0",
    "2**99999",
    "1;1",
    "None",
    "nan",
    "inf",
    "True",
    "\x00",
    "1\x002",
    "é🙂\u202e\ufeff",
    "٣٤٥",
    "\n",
    "lambda: 1",
    "[1, 2]",
    "0x10",
    "1_000",
]


def _case_ids(cases: list[tuple[str, int]]) -> list[str]:
    return [f"{name}-{d}" for name, d in cases]


@pytest.mark.parametrize(("name", "difficulty"), ALL_CASES, ids=_case_ids(ALL_CASES))
def test_solver_scores_one_within_length_and_alphabet(name: str, difficulty: int) -> None:
    """Every solver response scores 1.0, fits max_response_len, and prompts/responses use only ALPHABET."""
    task = make_task(name, difficulty)
    for example in task.examples("train", 200, seed=0) + task.examples("eval", 50, seed=7):
        response = task.solve(example)
        assert task.reward(example, response) == 1.0, (example, response)
        assert len(response) <= task.max_response_len, (example, response)
        assert set(example.prompt + response + example.target) <= set(ALPHABET), example


@pytest.mark.parametrize(("name", "difficulty"), FEW_CASES, ids=_case_ids(FEW_CASES))
def test_malformed_responses_score_zero(name: str, difficulty: int) -> None:
    """A battery of malformed, hostile and non-ASCII responses scores exactly 0.0 without raising."""
    task = make_task(name, difficulty)
    for example in task.examples("eval", 10, seed=1):
        for response in MALFORMED:
            assert task.reward(example, response) == 0.0, (example, response)


@pytest.mark.parametrize(("name", "difficulty"), FEW_CASES, ids=_case_ids(FEW_CASES))
def test_reward_is_binary_on_random_and_perturbed_strings(name: str, difficulty: int) -> None:
    """Reward is 0.0 or 1.0 on random ALPHABET strings and on one-character edits of correct responses."""
    task = make_task(name, difficulty)
    rng = random.Random(0)
    for example in task.examples("eval", 20, seed=2):
        correct = task.solve(example)
        candidates = ["".join(rng.choices(ALPHABET, k=rng.randint(0, 40))) for _ in range(50)]
        for _ in range(50):
            i = rng.randrange(len(correct))
            candidates.append(correct[:i] + rng.choice(ALPHABET) + correct[i + 1 :])
        for response in candidates:
            assert task.reward(example, response) in (0.0, 1.0), (example, response)


@pytest.mark.parametrize(("name", "difficulty"), FEW_CASES, ids=_case_ids(FEW_CASES))
def test_generation_is_reproducible_and_seed_dependent(name: str, difficulty: int) -> None:
    """Same (split, seed) gives identical examples; another seed gives a different stream."""
    task = make_task(name, difficulty)
    first = task.examples("train", 30, seed=3)
    assert first == make_task(name, difficulty).examples("train", 30, seed=3)
    assert first != task.examples("train", 30, seed=4)
    assert first == [task.sample(rng) for rng in [random.Random(split_seed("train", 3))] for _ in range(30)]


def test_split_seeds_are_disjoint() -> None:
    """No train seed maps to the RNG seed of any eval seed, and distinct seeds map to distinct RNG seeds."""
    seeds = range(1000)
    train = {split_seed("train", s) for s in seeds}
    eval_ = {split_seed("eval", s) for s in seeds}
    assert len(train) == len(eval_) == len(seeds)
    assert not train & eval_


@pytest.mark.parametrize(("name", "difficulty"), [("arithmetic", 3), ("countdown", 3), ("countdown", 5)])
def test_train_and_eval_prompts_differ(name: str, difficulty: int) -> None:
    """With the same seed, the first 50 train and eval prompts differ position by position."""
    task = make_task(name, difficulty)
    for seed in (0, 1, 12345):
        train = [e.prompt for e in task.examples("train", 50, seed)]
        eval_ = [e.prompt for e in task.examples("eval", 50, seed)]
        assert all(a != b for a, b in zip(train, eval_, strict=True))


@pytest.mark.parametrize(("split", "seed"), [("test", 0), ("", 0), ("train", -1), ("eval", 1.5)])
def test_examples_rejects_bad_split_or_seed(split: str, seed: int) -> None:
    """An unknown split or a negative/non-integer seed raises ValueError."""
    with pytest.raises(ValueError, match="split|seed"):
        make_task("sort", 4).examples(split, 3, seed)


def test_make_task_unknown_name_names_field() -> None:
    """An unknown task name raises ValueError naming task.name and listing the valid names."""
    with pytest.raises(ValueError, match=r"task\.name") as info:
        make_task("chess", 1)
    for name in TASKS:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("name", "difficulty"),
    [
        ("arithmetic", 0),
        ("arithmetic", 7),
        ("sort", 1),
        ("sort", 33),
        ("countdown", 1),
        ("countdown", 7),
        ("sort", True),
        ("sort", 4.0),
    ],
)
def test_make_task_bad_difficulty_names_field(name: str, difficulty: int) -> None:
    """An out-of-range or non-integer difficulty raises ValueError naming task.difficulty."""
    with pytest.raises(ValueError, match=r"task\.difficulty"):
        make_task(name, difficulty)


def test_registry_names_match_classes() -> None:
    """Each registry key is its class's name and builds a Task of that class."""
    for name, cls in TASKS.items():
        task = make_task(name, cls.min_difficulty)
        assert isinstance(task, Task) and type(task) is cls and task.name == name


def test_sort_response_length_grows_with_n() -> None:
    """Sort responses are exactly 2N - 1 characters, so length strictly grows with N."""
    lengths = []
    for n in range(2, 33):
        task = make_task("sort", n)
        example = task.examples("train", 1, seed=0)[0]
        assert len(task.solve(example)) == task.max_response_len == 2 * n - 1
        lengths.append(len(task.solve(example)))
    assert lengths == sorted(set(lengths))


def test_sort_rejects_near_misses() -> None:
    """Sort rewards only the exact sorted multiset in order: unsorted, missing or extra items score 0."""
    task = make_task("sort", 4)
    example = Example(prompt="sort 5 3 9 3:", target="3 3 5 9", data=(5, 3, 9, 3))
    assert task.reward(example, "3 3 5 9") == 1.0
    assert task.reward(example, "  3  3 5 9 ") == 1.0
    for wrong in ["5 3 9 3", "3 5 9", "3 3 5 9 9", "3 3 9 5", "3359", "3,3,5,9", "3 3 5 09", "03 3 5 9"]:
        assert task.reward(example, wrong) == 0.0, wrong


def test_arithmetic_target_matches_operands() -> None:
    """Arithmetic operands have exactly d digits and the target is a + b or a - b."""
    for d in range(1, 7):
        for example in make_task("arithmetic", d).examples("train", 100, seed=5):
            a, op, b = example.data
            assert len(str(a)) == len(str(b)) == d
            assert example.prompt == f"{a}{op}{b}="
            assert int(example.target) == (a + b if op == "+" else a - b)


def test_arithmetic_parses_integers_exactly() -> None:
    """Arithmetic accepts the exact integer (spaces, leading zeros) and rejects anything else."""
    task = make_task("arithmetic", 2)
    negative = Example(prompt="10-22=", target="-12", data=(10, "-", 22))
    for right in ["-12", " -12 ", "-012"]:
        assert task.reward(negative, right) == 1.0, right
    for wrong in ["12", "-11", "-13", "--12", "- 12", "-12.0", "+-12", "-1 2", "-12=", "-12\n", "-١٢"]:
        assert task.reward(negative, wrong) == 0.0, wrong
    zero = Example(prompt="12-12=", target="0", data=(12, "-", 12))
    assert [task.reward(zero, r) for r in ["0", "00", "-0", "1", ""]] == [1.0, 1.0, 1.0, 0.0, 0.0]


def _reference_expression(rng: random.Random, numbers: list[int]) -> tuple[str, int]:
    """Independent generator: a fully parenthesised random + - * expression and its value."""
    if len(numbers) == 1:
        return str(numbers[0]), numbers[0]
    split = rng.randint(1, len(numbers) - 1)
    left, a = _reference_expression(rng, numbers[:split])
    right, b = _reference_expression(rng, numbers[split:])
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"({left} {op} {right})", value


def test_countdown_evaluator_matches_reference() -> None:
    """The safe evaluator agrees with an independently computed value on random valid expressions."""
    rng = random.Random(0)
    for _ in range(500):
        numbers = [rng.randint(1, 50) for _ in range(rng.randint(1, 6))]
        text, value = _reference_expression(rng, numbers)
        assert evaluate_expression(text, tuple(numbers)) == value, text


def test_countdown_enforces_number_multiset_and_grammar() -> None:
    """Countdown rejects reused or foreign numbers, division, powers, unary minus and overlong input."""
    task = make_task("countdown", 3)
    example = Example(prompt="reach 24 with 4 6 3:", target="24", data=((4, 6, 3), "4*6"))
    assert task.reward(example, "4*6") == 1.0  # a subset of the numbers is allowed
    assert task.reward(example, " ( 4 * 6 ) ") == 1.0
    for wrong in [
        "24",
        "4*6*1",
        "6*4-0",
        "4*3*2",
        "(6+6)*(4-3+1)",
        "4*6/1",
        "8*3",
        "-(-4*6)",
        "4*6+3-3",
        "3*(4+6)-6",
        "4**2+8",
        "04*6",
        "4*6=24",
        "4*6+" + "0" * MAX_EXPRESSION_CHARS,
    ]:
        assert task.reward(example, wrong) == 0.0, wrong
    repeated = Example(prompt="reach 9 with 3 3 3:", target="9", data=((3, 3, 3), "3+3+3"))
    assert task.reward(repeated, "3*3") == 1.0
    assert task.reward(repeated, "3*(3+3)-3*3") == 0.0


def test_countdown_targets_in_range_and_prompt_lists_numbers() -> None:
    """Countdown targets lie in 0..999 and the prompt states the target and the numbers in data."""
    for k in range(2, 7):
        for example in make_task("countdown", k).examples("train", 100, seed=9):
            numbers, _ = example.data
            assert len(numbers) == k and 0 <= int(example.target) <= 999
            assert example.prompt == f"reach {example.target} with " + " ".join(map(str, numbers)) + ":"


@pytest.mark.parametrize(("name", "difficulty"), ALL_CASES, ids=_case_ids(ALL_CASES))
def test_difficulty_of_reads_back_the_drawn_difficulty(name: str, difficulty: int) -> None:
    """`difficulty_of` returns the difficulty every example was drawn at."""
    task = make_task(name, difficulty)
    assert {task.difficulty_of(ex) for ex in task.examples("train", 50, seed=0)} == {difficulty}


@pytest.mark.parametrize(("name", "mix"), [("sort", [2, 4, 8, 16]), ("arithmetic", [1, 3]), ("countdown", [2, 5])])
def test_mix_draws_every_listed_difficulty_reproducibly(name: str, mix: list[int]) -> None:
    """task.mix: every listed difficulty is drawn (about uniformly), the same stream again for the same
    (split, seed) and another for another seed or split; each example is solved and bounded at its own
    difficulty, and the task's bound is the longest of the mix."""
    task = make_task(name, mix[0], mix)
    examples = task.examples("train", 400, seed=0)
    drawn = [task.difficulty_of(ex) for ex in examples]
    assert set(drawn) == set(mix) and min(drawn.count(d) for d in mix) > 400 / len(mix) / 2
    assert examples == make_task(name, mix[0], mix).examples("train", 400, seed=0)
    assert examples != task.examples("train", 400, seed=1)
    assert [e.prompt for e in examples] != [e.prompt for e in task.examples("eval", 400, seed=0)]
    for ex, d in zip(examples, drawn, strict=True):
        single = make_task(name, d)
        assert task.reward(ex, task.solve(ex)) == 1.0
        assert len(task.solve(ex)) <= single.max_response_len <= task.max_response_len
    assert task.max_response_len == max(make_task(name, d).max_response_len for d in mix)


def test_mix_does_not_change_single_difficulty_streams() -> None:
    """An empty mix is no mix: make_task gives the plain task and its examples."""
    assert type(make_task("sort", 4, [])) is type(make_task("sort", 4))
    assert make_task("sort", 4, []).examples("train", 20, 0) == make_task("sort", 4).examples("train", 20, 0)


@pytest.mark.parametrize("mix", [[1, 4], [4, 33], [4, True], [4, 4.0]])
def test_mix_entries_outside_the_range_name_the_field(mix: list) -> None:
    """An entry of task.mix outside the task's difficulty range (or not an integer) raises ValueError naming task.mix."""
    with pytest.raises(ValueError, match=r"task\.mix=.*\[2, 32\]"):
        make_task("sort", 4, mix)


def test_mix_still_validates_difficulty() -> None:
    """With task.mix set, task.difficulty must still be a valid difficulty of the task."""
    with pytest.raises(ValueError, match=r"task\.difficulty"):
        make_task("sort", 1, [2, 4])
