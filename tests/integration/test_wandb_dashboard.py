"""`moe-rl-dashboard`: workspace and report specs checked against a real tiny run, built with wandb-workspaces."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.dashboard import (
    GROUPBY,
    REPORTS,
    build_report,
    build_workspace,
    experiment_text,
    library_json,
    report_specs,
    workspace_spec,
)
from moe_rl.train import CONF_DIR
from tests.helpers.wandb_offline import run_config
from tests.integration.test_train_loop import TINY

# Without a key, a netrc or a reachable server: any W&B network call fails.
NO_NETWORK = {"WANDB_API_KEY": "", "WANDB_BASE_URL": "http://127.0.0.1:9", "NETRC": "/nonexistent"}


def _script(name: str) -> str:
    """The console script installed with this interpreter (not another checkout's on PATH)."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or name


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A real two-step `moe-rl-train` run (W&B offline) whose logged keys and W&B config the specs must match.
    It trains on rollouts one step stale (rollout.staleness=1), so the staleness panels' keys are logged too."""
    run_dir = tmp_path_factory.mktemp("dashboard") / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([_script("moe-rl-train"), *TINY, "warmstart.enabled=false", "logger.mode=offline", "rollout.staleness=1",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def rival_runs(tmp_path_factory) -> list[Path]:
    """Two more real two-step runs for the keys only the rivals log: dppo_tv under partial R2 replay with
    VCPO's step scale, and vespo."""
    runs = []
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    for overrides in (["objective=dppo_tv", "routing.replay=old", "routing.replay_score_ratio=0.5",
                       "trainer.ess_step_scale=sqrt"], ["objective=vespo"]):
        run_dir = tmp_path_factory.mktemp("dashboard") / overrides[0].split("=")[1]
        proc = subprocess.run([_script("moe-rl-train"), *TINY, "warmstart.enabled=false", "logger.mode=offline",
                               *overrides, f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                              timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(run_dir)
    return runs


def _all_specs() -> list[tuple[str, list[dict]]]:
    """(name, panels) of the workspace's sections and of every report."""
    ws = workspace_spec("e", "p")
    out = [(f"section {s['name']}", s["panels"]) for s in ws["sections"]]
    return out + [(f"report {r['experiment']}", r["panels"]) for r in report_specs("e", "p")]


def test_every_panel_key_is_logged_by_moe_rl_train(tiny_run, rival_runs):
    """Every key a panel plots is in a real run's metrics.jsonl (held-out eval keys included: the run
    evaluates at its last step), and every panel regex matches at least one logged key (the rivals' in
    their own runs)."""
    rows = [json.loads(line) for run in (tiny_run, *rival_runs)
            for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = set().union(*rows) - {"step"}
    for name, panels in _all_specs():
        for panel in panels:
            assert panel["keys"] or panel["regex"], f"{name}: panel {panel['title']!r} plots nothing"
            for key in panel["keys"]:
                assert key in logged, f"{name}: {key!r} is not logged"
            if panel["regex"]:
                assert any(re.search(panel["regex"], k) for k in logged), f"{name}: {panel['regex']!r} matches nothing"


def _flatten(config: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in config.items():
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= _flatten(value, f"{prefix}{key}.")
    return keys


def test_every_grouping_and_filter_key_is_in_the_wandb_config(tiny_run):
    """Every config key the workspace and the reports group or filter by is in the config stored in a real
    run's offline W&B log."""
    stored = _flatten(run_config(tiny_run))
    grouping = {*GROUPBY, *(key for r in REPORTS for key in r.groupby)}
    assert grouping <= stored, grouping - stored
    assert "experiment" in stored  # the filter Config('experiment') = NAME


def _panel_metrics(dump: dict) -> list[list[str]]:
    """The metric lists of every line plot in a wandb-workspaces JSON dump, in order."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("viewType") == "Run History Line Plot":
                config = node["config"]
                found.append(config.get("metrics", []) or [config["metricRegex"]])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dump)
    return found


def test_specs_serialise_with_wandb_workspaces():
    """The workspace and every report build as wandb-workspaces objects and dump through the library's own
    pydantic models, without network, to panels, log scales and grouping that match the spec."""
    spec = workspace_spec("e", "p", experiment="stability", group="g")
    dump = library_json(build_workspace(spec))
    panels = [p for s in spec["sections"] for p in s["panels"]]
    assert _panel_metrics(dump) == [list(p["keys"]) or [p["regex"]] for p in panels]
    logs = [c["config"].get("yLogScale", False) for s in dump["spec"]["section"]["panelBankConfig"]["sections"]
            for c in s["panels"]]
    assert logs == [p["log_y"] for p in panels]
    assert [s["name"] for s in dump["spec"]["section"]["panelBankConfig"]["sections"]] == [
        "learning", "clipping", "ratios", "routing volatility", "mismatch", "rivals", "collapse", "gradients",
        "time and throughput"]
    (runset,) = dump["spec"]["section"]["runSets"]
    assert [g["name"] for g in runset["grouping"]] == ["objective.value.preset", "routing.value.replay"]
    assert {(f["key"]["name"], f["value"]) for f in runset["filters"]["filters"]} == {
        ("experiment", "stability"), ("group", "g")}
    for report in report_specs("e", "p", group="g"):
        rdump = library_json(build_report(report))
        assert rdump["displayName"] == report["title"] and rdump["description"] == report["text"]
        assert _panel_metrics(rdump) == [list(p["keys"]) or [p["regex"]] for p in report["panels"]]
        (runset,) = [rs for b in rdump["spec"]["blocks"] for rs in b.get("metadata", {}).get("runSets", [])]
        assert [g["name"] for g in runset["grouping"]] == [
            k.replace(".", ".value.", 1) for k in report["groupby"]]
        filters = {(f["key"]["name"], f["value"]) for f in runset["filters"]["filters"]}
        assert filters == {("experiment", report["experiment"]), ("group", "g")}


def test_every_ablation_has_a_report_quoting_its_config_comment():
    """Each ablation in conf/experiment (all but the quickstart and the own-data example; a NAME__PART file is
    part of NAME) has exactly one report, whose text is the experiment file's header comment."""
    examples = {"quickstart", "own_data"}
    ablations = {p.stem.split("__")[0] for p in (Path(CONF_DIR) / "experiment").glob("*.yaml")} - examples
    assert sorted(r.experiment for r in REPORTS) == sorted(ablations), (
        "each conf/experiment ablation needs a ReportSpec in moe_rl.dashboard.REPORTS (and vice versa)")
    clipping = experiment_text("clipping")
    assert clipping.startswith("Ablation 2, clipping (Fig. 2)") and "@package" not in clipping
    assert "moe-rl-train" not in clipping
    for report in report_specs("e", "p"):
        assert report["text"] == experiment_text(report["experiment"]) and report["text"]


@pytest.mark.parametrize("library", [False, True])
def test_dry_run_prints_specs_without_network(library):
    """`moe-rl-dashboard --dry-run` (and with --library-json, the library's dump) prints the workspace and
    the experiment's report as JSON with W&B unreachable and no key."""
    args = [_script("moe-rl-dashboard"), "--entity", "e", "--project", "p", "--experiment", "length", "--dry-run"]
    proc = subprocess.run([*args, *(["--library-json"] if library else [])], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **NO_NETWORK})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert len(out["reports"]) == 1
    if library:
        assert out["workspace"]["displayName"] == "moe-rl, experiment length"
        assert out["reports"][0]["project"] == {"name": "p", "entityName": "e"}
    else:
        assert out["workspace"] == workspace_spec("e", "p", experiment="length")
        assert out["reports"] == report_specs("e", "p", experiment="length")


def test_unknown_experiment_fails_naming_the_option():
    """--experiment without a conf/experiment file exits 2 with an error naming --experiment."""
    proc = subprocess.run([sys.executable, "-m", "moe_rl.dashboard", "--entity", "e", "--experiment", "nope",
                           "--dry-run"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--experiment=nope" in proc.stderr.splitlines()[-1]
