"""experiments/reproduce.sh answers --help with its ablations, and an unknown name in one line (issue 56:
it printed a Hydra error)."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_help_lists_every_ablation_and_an_unknown_name_stops_in_one_line():
    """--help: rc 0, a usage line and one line per conf/experiment/NAME.yaml (parts aside) with its
    description; an unknown NAME: rc 2 and a message naming it, before any sweep starts."""
    run = subprocess.run(["bash", "experiments/reproduce.sh", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("usage: experiments/reproduce.sh NAME")
    names = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml") if "__" not in p.stem)
    listed = [line.split()[0] for line in run.stdout.splitlines()[2:]]
    assert listed == names and "@package" not in run.stdout
    bad = subprocess.run(["bash", "experiments/reproduce.sh", "no_such_ablation"], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.splitlines()[0].endswith("(no conf/experiment/no_such_ablation.yaml)")
