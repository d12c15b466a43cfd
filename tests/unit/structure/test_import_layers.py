"""moe_rl's import graph, read with `ast`: no circles between modules, and nothing points up a layer.

Every `import` and `from ... import` counts, at module level, inside a function or under
`if TYPE_CHECKING:` alike: a function-local import hides a circle from Python, not from a reader.
`LAYERS` lists moe_rl's layers bottom to top; a module may import modules of its own layer or of a lower
one. Each entry is a module or a package (the package and everything under it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

LAYERS: list[tuple[str, ...]] = [
    ("moe_rl.errors", "moe_rl.lazy", "moe_rl.reduction", "moe_rl.json_numbers", "moe_rl.provenance"),
    ("moe_rl.objectives", "moe_rl.routing", "moe_rl.tasks"),
    # the tokenizer knows a task's alphabet; the sampler records routing; the trainer's and the warm start's
    # sections of the schema sit beside their packages but below moe_rl.config, which composes them
    ("moe_rl.models", "moe_rl.rollout", "moe_rl.trainer.config", "moe_rl.warmstart.config"),
    ("moe_rl.config",),  # the schema: the sections composed into Config, and the checks across them; no I/O
    ("moe_rl.warmstart",),
    ("moe_rl.startup",),  # start-up checks that read files, build the task or look at the machine
    ("moe_rl.trainer",),  # moe_rl.trainer.run calls the start-up checks, which every rank enters
    ("moe_rl.train", "moe_rl.calibrate", "moe_rl.dashboard", "moe_rl.archive", "moe_rl.records", "moe_rl"),
]
"""Bottom to top. `moe_rl` (the package's own __init__) imports nothing and sits at the top with the entry points."""


def module_files(root: Path, package: str = "moe_rl") -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package` under `root`."""
    out = {}
    for p in sorted((root / package).rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module of `modules` that `name` (a module, or a name inside one) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules: dict[str, Path], package: str = "moe_rl") -> dict[str, set[str]]:
    """module -> the modules of `package` it imports anywhere in its source (relative imports resolved)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(_owner(a.name, modules) for a in node.names if a.name.split(".")[0] == package)
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                if target.split(".")[0] != package:
                    continue
                for a in node.names:  # `from pkg import sub` imports the submodule pkg.sub
                    full = f"{target}.{a.name}"
                    deps.add(full if full in modules else _owner(target, modules))
        graph[name] = {d for d in deps if d is not None and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str, layers: list[tuple[str, ...]]) -> int | None:
    """The index of the layer whose most specific entry covers `module` (None when none does). The root
    package's entry (`moe_rl`, no dot) covers its own __init__ only, so an unplaced module is still caught."""
    best, depth = None, -1
    for i, entries in enumerate(layers):
        for entry in entries:
            covers = module == entry or ("." in entry and module.startswith(entry + "."))
            if covers and entry.count(".") > depth:
                best, depth = i, entry.count(".")
    return best


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    """`a -> b` for every import of a module in a higher layer; a module in no layer is reported too."""
    found = []
    for a in sorted(graph):
        la = layer_of(a, layers)
        if la is None:
            found.append(f"{a}: in no layer")
            continue
        found += [f"{a} -> {b}" for b in sorted(graph[a]) if (layer_of(b, layers) or 0) > la]
    return found


def test_no_import_cycles_in_moe_rl():
    """No two modules of moe_rl import each other, directly or around a circle, even from inside a function."""
    found = cycles(import_graph(module_files(ROOT)))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_module_imports_a_higher_layer():
    """Every moe_rl module is in a layer of LAYERS and imports only its own layer or lower ones."""
    found = upward_imports(import_graph(module_files(ROOT)), LAYERS)
    assert not found, "imports that point up (or modules in no layer):\n" + "\n".join(found)


def test_config_is_the_schema_alone():
    """moe_rl.config reads no files and builds no task: it imports no I/O library and none of tasks' builders."""
    tree = ast.parse((ROOT / "moe_rl" / "config.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"json", "pathlib", "Path", "safetensors", "safe_open", "torch", "build_task", "make_task"}


def _write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return module_files(root)


def test_the_scan_finds_a_cycle_through_a_function_local_import(tmp_path):
    """a imports b at the top and b imports a inside a function: the scan reports the circle (and no other)."""
    modules = _write(tmp_path, {
        "moe_rl/__init__.py": "",
        "moe_rl/a.py": "from moe_rl.b import f\n",
        "moe_rl/b.py": "def f():\n    from moe_rl import a\n    return a\n",
        "moe_rl/c.py": "from . import a\n",
    })
    assert cycles(import_graph(modules)) == [["moe_rl.a", "moe_rl.b"]]


def test_the_scan_finds_an_upward_import_and_an_unplaced_module(tmp_path):
    """A low module importing a higher one (relative import, under TYPE_CHECKING) is reported, as is a module in no layer."""
    modules = _write(tmp_path, {
        "moe_rl/__init__.py": "",
        "moe_rl/low/__init__.py": "",
        "moe_rl/low/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..high import Y\n",
        "moe_rl/high.py": "from moe_rl.low import x\n",
        "moe_rl/stray.py": "",
    })
    layers = [("moe_rl.low",), ("moe_rl.high", "moe_rl")]
    graph = import_graph(modules)
    assert graph["moe_rl.high"] == {"moe_rl.low.x"}
    assert upward_imports(graph, layers) == ["moe_rl.low.x -> moe_rl.high", "moe_rl.stray: in no layer"]


@pytest.mark.parametrize("module, layer", [("moe_rl.warmstart.demos", 4), ("moe_rl.tasks.registry", 1),
                                           ("moe_rl.trainer.run", 6), ("moe_rl", 7)])
def test_layer_of_takes_the_package_entry(module, layer):
    """A module is placed by the package entry that covers it (moe_rl itself only by its own entry)."""
    assert layer_of(module, LAYERS) == layer
