"""Write a small grade-school-math-style dataset: arithmetic word problems with worked numeric answers.

    python examples/make_gsm_style.py                        # examples/gsm_style.jsonl, 1000 rows, seed 0
    python examples/make_gsm_style.py --rows 5000 --seed 1 --out /tmp/more.jsonl

Each line is {"question": ..., "answer": ...} in GSM8K's layout: the answer is a worked solution, one
equation per line, then "#### <number>", so the last_number verifier reads the final number, and the
answer as a whole is a full response the warm start can imitate. Problems are one step (+, -, x, /)
or, for a fifth of them, two steps, on numbers small enough that every result is a whole number from
0 to 200. The output is a pure function of --rows and --seed; the committed file is the default.
This is moe-rl's own data, made here, not downloaded: `conf/experiment/own_data.yaml` trains on it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ava", "Ben", "Cara", "Dev", "Emma", "Finn", "Gia", "Hugo", "Ines", "Jack", "Kira", "Leo", "Mia",
         "Noah", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "books", "shells", "stamps", "cards", "beads",
         "balloons", "coins", "crayons", "eggs", "flowers"]


def _add(rng: random.Random, name: str, item: str) -> tuple[str, list[str], int]:
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    return f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?", [f"{a} + {b} = {a + b}"], a + b


def _sub(rng: random.Random, name: str, item: str) -> tuple[str, list[str], int]:
    a = rng.randint(5, 90)
    b = rng.randint(1, a - 1)
    return f"{name} had {a} {item} and gave {b} away. How many {item} does {name} have left?", [f"{a} - {b} = {a - b}"], a - b


def _mul(rng: random.Random, name: str, item: str) -> tuple[str, list[str], int]:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return f"{name} fills {a} bags with {b} {item} in each bag. How many {item} are in the bags?", [f"{a} * {b} = {a * b}"], a * b


def _div(rng: random.Random, name: str, item: str) -> tuple[str, list[str], int]:
    b, q = rng.randint(2, 10), rng.randint(2, 12)
    return (f"{name} shares {b * q} {item} equally among {b} friends. How many {item} does each friend get?",
            [f"{b * q} / {b} = {q}"], q)


def _two_step(rng: random.Random, name: str, item: str) -> tuple[str, list[str], int]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, a * b - 1)
    question = (f"{name} buys {a} packs of {b} {item} and then gives {c} to a friend. "
                f"How many {item} does {name} have now?")
    return question, [f"{a} * {b} = {a * b}", f"{a * b} - {c} = {a * b - c}"], a * b - c


ONE_STEP = [_add, _sub, _mul, _div]


def make_rows(n: int, seed: int) -> list[dict[str, str]]:
    """`n` problems from `random.Random(seed)`: four in five one step (operation uniform), one in five two."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        kind = _two_step if rng.random() < 0.2 else rng.choice(ONE_STEP)
        question, steps, value = kind(rng, rng.choice(NAMES), rng.choice(ITEMS))
        rows.append({"question": question, "answer": "\n".join([*steps, f"#### {value}"])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("gsm_style.jsonl"))
    args = parser.parse_args()
    with args.out.open("w") as f:
        for row in make_rows(args.rows, args.seed):
            f.write(json.dumps(row) + "\n")
    print(f"wrote {args.rows} rows to {args.out}")


if __name__ == "__main__":
    main()
