"""A metric's reduction is decided by its `moe_rl.reduction.Stat` kind, never by its key: checked over the
source with `ast`, no code of moe_rl/reduction.py or moe_rl/trainer/ tests a metric key's suffix or prefix
(`key.endswith("/sum")`, `key.startswith("ratio/")`, `"/max" in key`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RENAMES = {"moe_rl/trainer/evaluate.py": "renames the initial evaluation's `eval/` keys to `eval/initial/`"}
"""Files allowed a test of a key's prefix, and why: a rename that reduces nothing."""


def _fragments(node: ast.expr) -> list[str]:
    """The string constants of an argument: a string, an f-string's literal parts, or a literal of them."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    out = []
    for item in items:
        parts = item.values if isinstance(item, ast.JoinedStr) else [item]
        out += [p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)]
    return out


def key_pattern_tests(sources: list[Path], root: Path = ROOT) -> list[str]:
    """`file:line` (once a line, in order) for every test of a metric key's suffix or prefix: a `startswith`, `endswith`,
    `removeprefix` or `removesuffix` call with a fragment holding `/`, or `fragment in x` with a fragment
    that begins or ends with `/` (a key, `"a/b" in metrics`, is a lookup, not a pattern)."""
    found = set()
    for p in sources:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            hit = False
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "startswith", "endswith", "removeprefix", "removesuffix"
            ):
                hit = any("/" in f for a in node.args for f in _fragments(a))
            elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
                hit = any(f.startswith("/") or f.endswith("/") for f in _fragments(node.left))
            if hit:
                found.add((str(p.relative_to(root)), node.lineno))
    return [f"{name}:{line}" for name, line in sorted(found)]


def test_no_reduction_is_decided_by_a_key_suffix_or_prefix():
    """moe_rl/reduction.py and moe_rl/trainer/ never test a metric key's suffix or prefix (but for the
    renames in RENAMES): every step quantity reduces by its Stat's kind."""
    sources = [ROOT / "moe_rl" / "reduction.py", *sorted((ROOT / "moe_rl" / "trainer").rglob("*.py"))]
    found = [f for f in key_pattern_tests(sources) if f.split(":")[0] not in RENAMES]
    assert found == [], f"metric keys tested by suffix or prefix: {found}"


def test_the_scan_finds_a_reduction_by_key_pattern(tmp_path):
    """The old `*/sum` rule, the `ratio/.../max` selection, an f-string prefix and an `in` fragment are
    found; a key lookup, a path test and a plain string's prefix are not."""
    src = tmp_path / "m.py"
    src.write_text(
        "def f(per_mb, key, m, r, path, name):\n"
        "    a = sum(x[key] for x in per_mb) if key.endswith('/sum') else 0\n"
        "    b = key.startswith('ratio/') and key.endswith(('/max', '/min'))\n"
        "    c = key.startswith(f'ratio/{r}')\n"
        "    d = '/sum' in key\n"
        "    e = 'rollout/reward/se' in m\n"
        "    g = path.suffix == '.py' or name.startswith('_') or path.endswith('.json')\n"
        "    return a, b, c, d, e, g\n"
    )
    assert key_pattern_tests([src], tmp_path) == ["m.py:2", "m.py:3", "m.py:4", "m.py:5"]
