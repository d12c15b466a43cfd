"""Rewards of the dataset task (`task=dataset`): built-in verifiers, and reward functions by import path.

Built-in verifiers score a response against the row's answer field, 1.0 or 0.0:
- `exact`: equal after normalisation (Unicode NFKC, case-folded, runs of whitespace as one space,
  surrounding whitespace dropped).
- `last_number`: the GSM8K convention. The reference is the last number after the answer's last `####`,
  or the answer's last number when it has no `####`; the response's last number must equal it as a
  rational number ("72", "72.0" and "72.00" agree; thousands separators as in "1,234" are read).
- `math`: `math_verify.verify(parse(answer), parse(response))` from the `math-verify` package, an
  optional extra (`pip install -e ".[math]"`); a missing package stops the run at start-up.

`task.reward_fn=package.module:function` scores instead: `function(prompt, response, example)` gets the
prompt as formatted by `task.template` (before any chat template), the decoded response and the dataset
row as a dict of its fields, and returns a float. It is imported and probed at start-up (`load_reward_fn`,
`moe_rl.tasks.dataset`). A reward is never Python `eval` of model output: verifiers only read the text.
"""

from __future__ import annotations

import importlib
import re
import unicodedata
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from moe_rl.errors import RunError

RewardFn = Callable[[str, str, dict[str, Any]], float]
"""A user reward: (prompt, response, example row) -> float."""

VERIFIERS = ("exact", "last_number", "math")
"""Valid `task.verifier` values."""

REWARD_FN_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
"""The form of `task.reward_fn`: a dotted module path, a colon, a dotted attribute path."""

MATH_EXTRA = 'pip install -e ".[math]" in the repository, as docs/training.md installs it (or pip install math-verify)'

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def normalise(text: str) -> str:
    """`exact`'s normal form: NFKC, case-folded, whitespace runs as one space, stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def last_number(text: str) -> Fraction | None:
    """The last number written in `text` as an exact rational (commas between digit groups dropped), or None."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def reference_number(answer: str) -> Fraction | None:
    """`last_number`'s reference: the last number after the answer's last `####`, else its last number."""
    return last_number(answer.rsplit("####", 1)[-1])


def exact(response: str, answer: str) -> float:
    """1.0 when the normalised response equals the normalised answer."""
    return float(normalise(response) == normalise(answer))


def last_number_match(response: str, answer: str) -> float:
    """1.0 when the response's last number equals the answer's reference number."""
    got = last_number(response)
    return float(got is not None and got == reference_number(answer))


class MathVerifier:
    """`math`: math-verify's parse and verify; gold answers are parsed once and kept."""

    def __init__(self) -> None:
        self.math_verify = import_math_verify()
        self._gold: dict[str, Any] = {}

    def __call__(self, response: str, answer: str) -> float:
        if answer not in self._gold:
            self._gold[answer] = self.math_verify.parse(answer)
        return float(bool(self.math_verify.verify(self._gold[answer], self.math_verify.parse(response))))


def import_math_verify() -> Any:
    """The `math_verify` module; ValueError naming task.verifier, with the install command, when absent."""
    try:
        return importlib.import_module("math_verify")
    except ImportError as err:
        raise ValueError(f"task.verifier=math needs the math-verify package, an optional extra: {MATH_EXTRA} ({err})") from err


def make_verifier(name: str) -> Callable[[str, str], float]:
    """The built-in verifier `name` as (response, answer) -> float; ValueError naming task.verifier."""
    if name == "exact":
        return exact
    if name == "last_number":
        return last_number_match
    if name == "math":
        return MathVerifier()
    raise ValueError(f"task.verifier={name!r}: expected one of {VERIFIERS}")


def load_reward_fn(spec: str) -> RewardFn:
    """Import `package.module:function` and check it is callable; ValueError naming task.reward_fn."""
    if REWARD_FN_SPEC.fullmatch(spec) is None:
        raise ValueError(f"task.reward_fn={spec!r}: expected package.module:function")
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except SystemExit as err:
        raise ValueError(exit_message(err, spec, f"while {module_name} was imported")) from None
    except KeyboardInterrupt as err:
        raise RewardFnExit(exit_message(err, spec, f"while {module_name} was imported")) from None
    except Exception as err:  # the user's module may fail in any way while it runs: report it in one line
        raise ValueError(
            f"task.reward_fn={spec}: cannot import {module_name} ({type(err).__name__}: {one_line(err)}); the module "
            "must be importable: installed, or on PYTHONPATH (python -m moe_rl.train also finds the current folder)"
        ) from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"task.reward_fn={spec}: {module_name} has no attribute {attr}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"task.reward_fn={spec}: {attr} is a {type(obj).__name__}, not a function")
    return obj


class RewardFnExit(RunError):
    """task.reward_fn raised SystemExit or KeyboardInterrupt: the run stops with one line naming it (a
    `SystemExit` would otherwise end the process without a word)."""


def exit_message(err: SystemExit | KeyboardInterrupt, spec: str, where: str) -> str:
    """One line saying that the user's reward function `spec` exited or was interrupted `where`."""
    if isinstance(err, SystemExit):
        return (f"task.reward_fn={spec} called sys.exit({err.code!r}) {where}: a reward function must return a "
                "float (or raise an exception, which scores the row 0), never exit")
    return f"task.reward_fn={spec} was interrupted (KeyboardInterrupt) {where}"


def one_line(err: BaseException) -> str:
    """An exception's message on one line (its first line, at most 200 characters)."""
    lines = str(err).strip().splitlines()
    text = lines[0] if lines else ""
    return text[:200] + ("..." if len(text) > 200 else "")
