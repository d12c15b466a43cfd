"""The README quickstart reproduces docs/golden/quickstart.json (experiments/quickstart_golden.py).

Tolerance: 1e-9 relative, i.e. exact up to float printing, and only where the machine matches the golden's
provenance in torch, transformers, CPU model and vector extensions, and thread count: there a run is bitwise
reproducible (docs/training.md, "Reproducibility"; tests/unit/trainer/test_provenance.py). Elsewhere one run's numbers are not
expected to hold (only the 6-seed orderings of docs/results.md do), so the rerun is skipped, saying why.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
from quickstart_golden import COMMAND, GOLDEN, MATCHING, measure, mismatches  # noqa: E402


def _fresh_provenance() -> dict:
    """The provenance a launched run sees: asked of a fresh interpreter, because this worker's thread count
    is whatever an earlier test in it (an in-process run with trainer.threads=1) left behind."""
    code = "import json; from moe_rl.provenance import provenance; print(json.dumps(provenance('cpu')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                          cwd=REPO)
    return json.loads(proc.stdout.splitlines()[-1])


def _golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_readme_quotes_the_golden_numbers():
    """Every final expected and held-out accuracy in docs/golden/quickstart.json appears, to 3 decimals, in the README's quickstart paragraph."""
    readme = (REPO / "README.md").read_text()
    table = _golden()["table"]
    for column in ("final expected acc", "final eval acc"):
        quoted = ", ".join(f"{table[label][column]:.3f}" for label in ("grpo (replay=off)", "grpo_rr (replay=old)",
                                                                        "gspo (replay=off)"))
        assert quoted in readme, (column, quoted)


@pytest.mark.slow
def test_quickstart_reproduces_the_golden_table(tmp_path):
    """The README's quickstart command, from an empty warm-start cache, gives the golden table and warm start to 1e-9 on a machine of the golden's provenance."""
    golden = _golden()
    here = _fresh_provenance()
    differ = [f"{k} {here[k]} (golden: {golden['provenance'][k]})" for k in MATCHING if here[k] != golden["provenance"][k]]
    if differ:
        pytest.skip("one run's numbers hold only on the golden's provenance; here: " + ", ".join(differ))
    args = [sys.executable, "-m", "moe_rl.train", *COMMAND.split()[1:], "logger.progress=false",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", f"warmstart.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=3600, cwd=tmp_path,
                          env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert mismatches(measure(tmp_path / "sweep"), golden) == []
