"""The code's sizes and single writers, checked over the source with `ast` (docs STYLE.md: no function over
about 80 lines; torchtitan's loop, short enough to read in one screen): no function in moe_rl/ over 80 lines,
run.py at most 300 lines and its `_train` at most 60, and the `collapse/events` metric written in one place."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RUN = ROOT / "moe_rl" / "trainer" / "run.py"
MAX_FUNCTION = 80
MAX_RUN = 300
MAX_TRAIN = 60


def function_lengths(sources: list[Path], root: Path = ROOT) -> dict[str, int]:
    """`file:line name` -> lines from `def` to the function's last line, for every function and method."""
    out = {}
    for p in sources:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out[f"{p.relative_to(root)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    return out


def metric_writes(sources: list[Path], key: str, root: Path = ROOT) -> list[str]:
    """`file:line` for every place that writes the metric `key`: a key of a dict display (`{key: v}`) or a
    subscript assigned to (`metrics[key] = v`). Reads (`row[key]`, a tuple of names) are not writes."""
    found = []
    for p in sources:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            keys = (
                node.keys if isinstance(node, ast.Dict)
                else [node.slice] if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) else []
            )
            if any(isinstance(k, ast.Constant) and k.value == key for k in keys):
                found.append(f"{p.relative_to(root)}:{node.lineno}")
    return found


def _library() -> list[Path]:
    return sorted((ROOT / "moe_rl").rglob("*.py"))


def test_no_function_in_the_library_is_over_80_lines():
    """Every function and method of moe_rl/ is at most 80 lines long, `def` to last line."""
    long = {k: n for k, n in function_lengths(_library()).items() if n > MAX_FUNCTION}
    assert not long, f"functions over {MAX_FUNCTION} lines: {long}"


def test_the_run_module_and_its_train_function_are_short():
    """moe_rl/trainer/run.py is at most 300 lines, and its `_train` at most 60: the loop reads in one screen."""
    assert len(RUN.read_text().splitlines()) <= MAX_RUN
    lengths = {k.split()[-1]: n for k, n in function_lengths([RUN]).items()}
    assert lengths["_train"] <= MAX_TRAIN, lengths["_train"]


def test_collapse_events_is_written_in_one_place():
    """One place in moe_rl/ writes `collapse/events` (moe_rl.trainer.collapse.collapse_metrics)."""
    writes = metric_writes(_library(), "collapse/events")
    assert len(writes) == 1 and writes[0].startswith("moe_rl/trainer/collapse.py"), writes


def test_the_scans_find_a_long_function_and_every_write(tmp_path):
    """An 81-line function is measured at 81 lines; a dict key and a subscript store are writes, a read and
    a tuple of names are not (so the tests above can fail)."""
    src = tmp_path / "m.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    src.write_text(
        f"def long():\n{body}"
        "def f(m, row):\n"
        "    m['collapse/events'] = 1.0\n"
        "    out = {'collapse/events': 2.0}\n"
        "    seen = row['collapse/events']\n"
        "    keys = ('collapse/events',)\n"
    )
    assert function_lengths([src], tmp_path)["m.py:1 long"] == 81
    assert metric_writes([src], "collapse/events", tmp_path) == ["m.py:83", "m.py:84"]
