"""Smoke test of the routing-overhead benchmark script."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONDITIONS = ("plain", "hooks_idle", "record", "record_logits", "replay", "plain_fwd_bwd", "replay_fwd_bwd")


def test_routing_overhead_script_reports_every_condition(tmp_path):
    """At a tiny size the script times every condition (positive median, ratio to its baseline) into JSON and .md."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "experiments/bench/routing_overhead.py"), "--batch", "2", "--seq", "8"]
    cmd += ["--repeats", "2", "--warmup", "1", "--layers", "2", "--threads", "1", "--grad", "--out", str(out)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, timeout=600)
    report = json.loads(out.read_text())
    assert set(report["conditions"]) == set(CONDITIONS)
    for name, r in report["conditions"].items():
        assert r["median_seconds"] > 0, name
        assert (
            r["ratio_vs_baseline"]
            == r["median_seconds"] / report["conditions"][r["baseline"]]["median_seconds"]
        )
    assert report["conditions"]["plain"]["ratio_vs_baseline"] == 1.0
    assert report["trace_bytes_per_token"]["ids"] == 2 * 2  # L=2 layers * K=2 uint8 ids
    assert out.with_suffix(".md").exists()
