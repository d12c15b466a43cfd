"""The code's shape, checked over the source with `ast`: no private name is imported across modules, the
library (moe_rl/) never imports the analysis (analysis/), one module alone decides which routing a
forward uses (moe_rl/trainer/plan.py), reading the replay source's row of `moe_rl.routing.config.REPLAY`
rather than comparing routing.replay with a name, and only the rollout package compares `sampler.engine`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("moe_rl", "analysis", "experiments", "tests")
ROUTING_FIELDS = {"replay", "noise_scope"}
"""RoutingConfig fields whose value decides which routing a forward uses."""
PLAN = "moe_rl/trainer/plan.py"
ROUTING_PACKAGE = "moe_rl/routing/"
"""Where the replay sources are named: their table (REPLAY) and RoutingConfig.validate."""


def _sources(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def _project_modules() -> set[str]:
    """Names a project module is imported by: dotted package paths (tests/ is a package too, so tests import
    each other and tests/helpers/ as `tests.unit.routing.test_router_noise`)."""
    names = set()
    for p in _sources(*PACKAGES):
        rel = p.relative_to(ROOT).with_suffix("")
        names.add(".".join(rel.parts).removesuffix(".__init__"))
    return names


def private_imports(sources: list[Path], modules: set[str], root: Path = ROOT) -> list[str]:
    """`file: from module import _name` for every private name imported from another project module."""
    found = []
    for p in sources:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{p.relative_to(root)}: from {node.module} import {alias.name}")
    return found


def imports_of(sources: list[Path], package: str, root: Path = ROOT) -> list[str]:
    """`file:line` for every import of `package` or a module under it (`import x`, `from x.y import z`)."""
    found = []
    for p in sources:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = (
                [a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            )
            if any(n == package or n.startswith(package + ".") for n in names):
                found.append(f"{p.relative_to(root)}:{node.lineno}")
    return found


def routing_branches(sources: list[Path], root: Path = ROOT) -> dict[str, list[int]]:
    """Lines, per file, where the value of `routing.replay` or `routing.noise_scope` is compared or used as
    a key (a branch on it), outside the config schema's `validate` methods (which refuse bad combinations
    and decide nothing about a forward). Calls such as `controller.replay(trace)` are not reads of it."""
    out: dict[str, list[int]] = {}
    for p in sources:
        tree = ast.parse(p.read_text(), str(p))
        skip: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and "validate" in fn.name:
                skip.update(id(n) for n in ast.walk(fn))
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            parts = (
                [node.left, *node.comparators] if isinstance(node, ast.Compare)
                else [node.slice] if isinstance(node, ast.Subscript) else []
            )
            for part in parts:
                if isinstance(part, ast.Attribute) and part.attr in ROUTING_FIELDS:
                    out.setdefault(str(p.relative_to(root)), []).append(node.lineno)
    return out


def _is_replay(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "replay" or isinstance(node, ast.Name) and node.id == "replay"


def _is_names(node: ast.expr) -> bool:
    """A string, or a tuple, list or set literal holding one."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return any(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items)


def replay_comparisons(sources: list[Path], root: Path = ROOT) -> list[str]:
    """`file:line` for every comparison of a `replay` (attribute or name) with a string or a literal of
    strings (`replay == "old"`, `"rollout" != cfg.replay`, `replay in ("old", "rollout")`)."""
    found = []
    for p in sources:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(map(_is_replay, operands)) and any(map(_is_names, operands)):
                    found.append(f"{p.relative_to(root)}:{node.lineno}")
    return found


def test_no_module_outside_routing_compares_the_replay_source_with_a_name():
    """Outside moe_rl/routing/ no module of moe_rl/ compares routing.replay with a string: each reads the
    source's row of moe_rl.routing.config.REPLAY (which routing each forward uses, what it is immune to)."""
    sources = [p for p in _sources("moe_rl") if not str(p.relative_to(ROOT)).startswith(ROUTING_PACKAGE)]
    assert replay_comparisons(sources) == []


def test_the_scan_finds_a_comparison_of_the_replay_source(tmp_path):
    """==, != and `in` a literal of names are found, with the name on either side; a row lookup, a call
    and a comparison of another field are not."""
    src = tmp_path / "m.py"
    src.write_text(
        "def f(cfg, replay, ctl, t):\n"
        "    a = cfg.routing.replay == 'old'\n"
        "    b = 'rollout' != replay\n"
        "    c = cfg.replay in ('old', 'rollout')\n"
        "    d = REPLAY[cfg.routing.replay].update_forward == SAMPLER\n"
        "    e = cfg.routing.noise_scope == 'update'\n"
        "    return ctl.replay(t), a, b, c, d, e\n"
    )
    assert replay_comparisons([src], tmp_path) == ["m.py:2", "m.py:3", "m.py:4"]


def test_no_private_name_is_imported_across_modules():
    """No module of moe_rl/, analysis/, experiments/ or tests/ imports another project module's `_name`."""
    found = private_imports(_sources(*PACKAGES), _project_modules())
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_the_scan_finds_a_private_import(tmp_path):
    """The scan reports a `from moe_rl.x import _y` it is shown (so the test above can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from moe_rl.trainer.run import _hidden, train\nfrom os import _exit\n")
    assert private_imports([bad], {"moe_rl.trainer.run"}, tmp_path) == ["bad.py: from moe_rl.trainer.run import _hidden"]


def test_the_library_never_imports_the_analysis():
    """No module of moe_rl/ imports analysis/ (the analysis reads the library's outputs, never the reverse)."""
    assert imports_of(_sources("moe_rl"), "analysis") == []


def test_the_scan_finds_an_import_of_the_analysis(tmp_path):
    """`import analysis.x` and `from analysis.x import y` are found; `from analysis_tools import z` is not."""
    src = tmp_path / "m.py"
    src.write_text("import analysis.stats\nfrom analysis.compare import main\nfrom analysis_tools import z\n")
    assert imports_of([src], "analysis", tmp_path) == ["m.py:1", "m.py:2"]


def test_one_module_branches_on_the_replay_source_and_the_noise_scope():
    """Only moe_rl/trainer/plan.py (RoutingPlan) compares or dispatches on routing.replay or
    routing.noise_scope; every other module asks the plan."""
    branches = routing_branches(_sources("moe_rl"))
    assert set(branches) == {PLAN}, {k: v for k, v in branches.items() if k != PLAN}


def test_the_scan_finds_a_branch_on_the_replay_source(tmp_path):
    """A comparison or a dict dispatch on `.replay` is a branch; a call `controller.replay(t)` and a
    check inside a `validate` method are not."""
    src = tmp_path / "m.py"
    src.write_text(
        "def f(cfg, ctl, t):\n"
        "    ctl.replay(t)\n"
        "    if cfg.routing.replay == 'old':\n"
        "        pass\n"
        "    return {'off': 0}[cfg.routing.noise_scope]\n"
        "def validate(self):\n"
        "    assert self.replay in ('off', 'old')\n"
    )
    assert routing_branches([src], tmp_path) == {"m.py": [3, 5]}


def comparisons(sources: list[Path], attr: str, root: Path = ROOT, validate: bool = False) -> list[str]:
    """`file:line` for every comparison (`==`, `!=`, `in`, ...) of an attribute named `attr`, outside the
    config schema's `validate` methods (which refuse bad combinations and decide nothing) unless `validate`.
    A lookup in a table (`ENGINES[cfg.engine]`) is not a comparison: a missing row fails loudly."""
    found = []
    for p in sources:
        tree = ast.parse(p.read_text(), str(p))
        skip: set[int] = set()
        for fn in ast.walk(tree):
            if not validate and isinstance(fn, ast.FunctionDef) and "validate" in fn.name:
                skip.update(id(n) for n in ast.walk(fn))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and id(node) not in skip and any(
                isinstance(part, ast.Attribute) and part.attr == attr for part in [node.left, *node.comparators]
            ):
                found.append(f"{p.relative_to(root)}:{node.lineno}")
    return found


def test_only_the_rollout_package_compares_the_sampler_engine():
    """Outside moe_rl/rollout/ nothing compares `sampler.engine`, the schema's validate methods included:
    they read the engine's row (moe_rl.rollout.engines.ENGINES), the trainer builds its sampler from its
    builder (moe_rl.trainer.sampling.BUILDERS) and asks the sampler (`Sampler.exact`)."""
    outside = [p for p in _sources("moe_rl") if "rollout" not in p.relative_to(ROOT).parts]
    assert comparisons(outside, "engine", validate=True) == []


def test_the_scan_finds_a_comparison_of_the_engine(tmp_path):
    """`cfg.engine == 'vllm'` and `'hf' != s.engine` are comparisons; a table lookup and a check inside a
    `validate` method are not."""
    src = tmp_path / "m.py"
    src.write_text(
        "def f(cfg, s, table):\n"
        "    if cfg.engine == 'vllm':\n"
        "        pass\n"
        "    return 'hf' != s.engine, table[cfg.engine]\n"
        "def _validate_x(self):\n"
        "    assert self.engine != 'vllm'\n"
    )
    assert comparisons([src], "engine", tmp_path) == ["m.py:2", "m.py:4"]


STEP = "moe_rl/trainer/step.py"


def whole_context_phases(path: Path) -> list[str]:
    """Functions of `path` other than rl_step with a parameter annotated StepContext: phases of the step
    that take the whole context rather than the fields they read."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name != "rl_step":
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            if any(a.annotation is not None and "StepContext" in ast.unparse(a.annotation) for a in args):
                found.append(node.name)
    return found


def test_the_phases_of_a_step_take_the_fields_they_read():
    """Only rl_step reads the whole StepContext; the old-policy and update phases take `Forwards`, the
    optimizer step `Stepper`, the step's record `MetricSettings` (issue 54, part 4)."""
    assert whole_context_phases(ROOT / STEP) == []


def test_the_scan_finds_a_phase_that_takes_the_whole_context(tmp_path):
    bad = tmp_path / "step.py"
    bad.write_text("def rl_step(ctx: StepContext, step): ...\ndef update(ctx: 'StepContext', batch): ...\n")
    assert whole_context_phases(bad) == ["update"]
