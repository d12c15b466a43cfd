"""Strict JSON with non-finite floats: NaN and ±inf are written as the strings "nan", "inf", "-inf", so
every file the project writes (metrics.jsonl, events.jsonl, summary.json, warmstart.json) parses with any
JSON reader; `from_json_number` reads such a string back. At the bottom: the warm start and the trainer's
logs both write it."""

from __future__ import annotations

import json
import math
from typing import Any


def jsonable(value: Any) -> Any:
    """`value` with every non-finite float, at any depth, replaced by its string ("nan", "inf", "-inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def to_json(value: Any, **kwargs: Any) -> str:
    """Strict JSON (`allow_nan=False`) under the NaN/inf convention of the module docstring."""
    return json.dumps(jsonable(value), allow_nan=False, **kwargs)


def from_json_number(value: Any) -> Any:
    """A metric value as written by `to_json`: "nan"/"inf"/"-inf" strings back to floats."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return value
