"""The README quickstart's numbers, as a committed file: docs/golden/quickstart.json.

    moe-rl-train -m +experiment=quickstart objective=grpo,grpo_rr,gspo hydra.sweep.dir=SWEEP
    python experiments/quickstart_golden.py SWEEP            # writes docs/golden/quickstart.json

The file holds the comparison table of that sweep (analysis.compare.comparison: one seed, so each
cell is that run's value), the warm start it started from, and the provenance the runs recorded, which
decides where the numbers hold: tests/integration/test_quickstart_golden.py (slow) reruns the command and asks for
the same table to 1e-9 when torch, transformers, the CPU vector extensions and the thread count are the
golden's (a same-provenance run is bitwise reproducible: docs/training.md, "Reproducibility"), and skips, saying
why, on any other machine, where one run's numbers are not expected to hold.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from analysis.compare import COLUMNS, comparison, run_dirs

GOLDEN = Path(__file__).resolve().parents[1] / "docs" / "golden" / "quickstart.json"
COMMAND = "moe-rl-train -m +experiment=quickstart objective=grpo,grpo_rr,gspo"
MATCHING = ("torch", "transformers", "cpu", "cpu_capability", "threads")
"""Provenance fields a rerun must share with the golden for its numbers to be expected bitwise equal. The CPU
model too: on an Intel Xeon with the golden's AVX512, torch and thread count, the quickstart's warm start
took 100 steps to 0.273 against the golden's 75 to 0.219 (measured on an AMD EPYC)."""


def measure(sweep_dir: Path) -> dict[str, Any]:
    """The golden record of a finished quickstart sweep: its table, warm start and provenance."""
    table = comparison(sweep_dir)
    summaries = [json.loads((d / "summary.json").read_text()) for d in run_dirs(sweep_dir)]
    # The code may move between the runs of one sweep (each records the commit it started from); the rest
    # of the provenance must be one machine's and one environment's.
    machine = [{k: v for k, v in s["provenance"].items() if not k.startswith("git_")} for s in summaries]
    if any(m != machine[0] for m in machine):
        raise SystemExit(f"{sweep_dir}: the runs' provenance differs; measure on one machine, in one environment")
    warm = json.loads((Path(summaries[0]["warmstart_path"]) / "warmstart.json").read_text())
    return {
        "command": COMMAND,
        "provenance": machine[0],
        "git": sorted({(s["provenance"]["git_commit"], s["provenance"]["git_dirty"]) for s in summaries}),
        "warmstart": {"steps": warm["steps"], "accuracy": warm["accuracy"]},
        "table": {
            label: {c: row[c] for c in COLUMNS if isinstance(row[c], float) and math.isfinite(row[c])}
            for label, row in sorted(table.items())
        },
    }


def mismatches(measured: dict[str, Any], golden: dict[str, Any], rel: float = 1e-9) -> list[str]:
    """Each table cell or warm-start value of `measured` that differs from `golden` beyond `rel`."""
    out = []
    for key in ("steps", "accuracy"):
        if not math.isclose(measured["warmstart"][key], golden["warmstart"][key], rel_tol=rel):
            out.append(f"warm start {key}: {measured['warmstart'][key]} != {golden['warmstart'][key]}")
    if measured["table"].keys() != golden["table"].keys():
        return [*out, f"rows {sorted(measured['table'])} != {sorted(golden['table'])}"]
    for label, row in golden["table"].items():
        for column, want in row.items():
            got = measured["table"][label].get(column, math.nan)
            if not math.isclose(got, want, rel_tol=rel, abs_tol=1e-12):
                out.append(f"{label} {column}: {got} != {want}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--out", type=Path, default=GOLDEN)
    args = parser.parse_args()
    record = measure(args.sweep_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{args.out}: {json.dumps(record['table'], indent=2)}")


if __name__ == "__main__":
    main()
