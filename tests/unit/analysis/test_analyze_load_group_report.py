"""moe-rl-analyze: loading runs (local folders, W&B records), grouping by config, tables, figures, report."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from scipy import stats as sps

from analysis.cli import main as analyze_main
from analysis.load import group_runs, load_local, load_wandb, read_local_run, run_from_wandb, varying_fields
from analysis.report import collapse_table, summary_table, write_report
from tests.helpers.report_text import first_table, section

REPO = Path(__file__).resolve().parents[3]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = {
    "reward_vs_step.png",
    "reward_vs_compute.png",
    "clip_fraction.png",
    "expert_change.png",
    "ratio_variance.png",
}
PRESETS = {
    "grpo": ("grpo", "off", 0.2, 0.27),
    "grpo_rr": ("grpo", "old", 0.2, 0.27),
    "gspo": ("gspo", "off", 3e-4, 4e-4),
}


def run_config(preset: str, seed: int, lr: float) -> dict:
    name, replay, low, high = PRESETS[preset]
    return {
        "objective": {"name": name, "preset": preset, "clip_low": low, "clip_high": high},
        "routing": {"replay": replay},
        "trainer": {"lr": lr, "prompts_per_step": 2, "group_size": 4, "threads": seed},
        "model": {"num_layers": 2, "seed": 0},
        "logger": {"group": f"g{seed}"},
        "seed": seed,
        "experiment": "hand",
    }


def run_metrics(clip: list, collapse_last: float = 0.0) -> list[dict]:
    rows = []
    for step, c in enumerate(clip):
        rows.append({
            "step": step, "rollout/reward/mean": 0.1 * (step + 1), "rollout/response_len/mean": 3.0 + step,
            "clip/token_frac": c, "ratio/token/var": "inf" if step == 0 else 0.01 * step,
            "ratio/token/within_seq_var": 0.001, "routing/expert_change/frac": 0.1,
            "routing/expert_change/after_one_update": 0.05, "routing/expert_change/layer_0": 0.05,
            "routing/expert_change/layer_1": 0.15, "time/step_s": 1.0,
            "collapse/events": collapse_last if step == len(clip) - 1 else 0.0,
        })  # fmt: skip
    return rows


def write_run(folder: Path, config: dict, rows: list[dict], events: list[dict] = ()) -> Path:
    """A run folder as moe-rl-train writes it: metrics.jsonl, events.jsonl, summary.json, .hydra/config.yaml."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    label = f"{config['objective']['preset']} (replay={config['routing']['replay']})"
    summary = {"label": label, "objective": config["objective"]["preset"], "replay": config["routing"]["replay"],
               "seed": config["seed"], "experiment": config["experiment"]}  # fmt: skip
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


@pytest.fixture
def hand_sweep(tmp_path: Path) -> Path:
    """grpo at two lrs (two seeds at 1e-4, one collapsing), gspo at 1e-4; folder names deliberately misleading."""
    root = tmp_path / "sweep"
    write_run(root / "objective=gspo,seed=0", run_config("grpo", 0, 1e-4), run_metrics([0.1, 0.3, 0.2]))
    write_run(root / "objective=gspo,seed=1", run_config("grpo", 1, 1e-4), run_metrics([0.4, "nan", 0.6], 1.0),
               [{"step": 2, "kind": "reward", "value": 0.1, "threshold": 0.2}])  # fmt: skip
    write_run(root / "lr" / "objective=grpo,seed=0", run_config("grpo", 0, 3e-4), run_metrics([0.5, 0.5, 0.5]))
    write_run(root / "objective=grpo,seed=9", run_config("gspo", 0, 1e-4), run_metrics([0.0, 0.0, 0.02]))
    (root / "unfinished").mkdir()
    (root / "unfinished" / "metrics.jsonl").write_text(
        json.dumps(run_metrics([0.9])[0]) + "\n"
    )  # no summary.json
    return root


def test_loader_groups_by_config_fields_and_skips_nan(hand_sweep):
    """Labels come from each run's config (not folder names); a field swept within a preset splits groups, seeds, logger and per-preset clip ranges do not; NaN/inf are left out of means."""
    runs = load_local([hand_sweep], progress=False)
    assert len(runs) == 4  # the folder without summary.json is skipped
    assert varying_fields(runs) == [
        "trainer.lr"
    ]  # clip ranges differ only between presets; seed/threads/logger ignored
    groups = group_runs(runs)
    assert list(groups) == [
        "grpo (replay=off) lr=0.0001",
        "grpo (replay=off) lr=0.0003",
        "gspo (replay=off) lr=0.0001",
    ]
    assert [r.seed for r in groups["grpo (replay=off) lr=0.0001"]] == [0, 1]
    nan_run = groups["grpo (replay=off) lr=0.0001"][1]
    assert math.isnan(nan_run.series("clip/token_frac")[1]) and math.isinf(
        nan_run.series("ratio/token/var")[0]
    )
    table = summary_table(groups)["grpo (replay=off) lr=0.0001"]
    assert table["seeds"] == [0, 1]
    assert table["clip frac"] == pytest.approx(
        (0.2 + 0.5) / 2, rel=1e-12
    )  # seed 1: mean(0.4, 0.6), nan skipped
    assert table["token-ratio var"] == pytest.approx(
        0.015, rel=1e-12
    )  # inf at step 0 skipped: mean(0.01, 0.02)
    assert table["final reward"] == pytest.approx(0.2, rel=1e-12)
    collapse = collapse_table(groups)["grpo (replay=off) lr=0.0001"]
    assert (collapse["seeds"], collapse["collapsed"], collapse["frac"], collapse["kinds"]) == (
        2,
        1,
        0.5,
        {"reward": 1},
    )


def test_varying_model_field_is_detected_and_labelled(tmp_path):
    """A swept model.num_layers is found without being named and appears in the labels as num_layers=N."""
    for layers in (1, 2):
        config = run_config("gspo", 0, 1e-4)
        config["model"]["num_layers"] = layers
        write_run(tmp_path / f"run{layers}", config, run_metrics([0.1]))
    runs = load_local([tmp_path], progress=False)
    assert varying_fields(runs) == ["model.num_layers"]
    assert list(group_runs(runs)) == ["gspo (replay=off) num_layers=1", "gspo (replay=off) num_layers=2"]


class _FakeWandbRun:
    """What the W&B public API returns for a run the trainer logged: nested config, history rows with _step."""

    def __init__(self, config: dict, rows: list[dict]):
        self.config = {"_wandb": {"x": 1}, **config}
        self._rows = rows
        self.path = ["ent", "proj", "abc123"]

    def scan_history(self):
        for row in self._rows:
            out = {k: ("NaN" if v == "nan" else v) for k, v in row.items() if k != "step"}
            yield {**out, "_step": row["step"], "_runtime": 1.5, "_timestamp": 1e9}


def test_wandb_runs_become_the_same_records_as_local_runs(hand_sweep, monkeypatch):
    """load_wandb asks the public API for the group's runs and turns each into the Run its local folder gives."""
    local = read_local_run(hand_sweep / "objective=gspo,seed=1")
    fake = _FakeWandbRun(local.config, run_metrics([0.4, "nan", 0.6], 1.0))
    calls = []

    class Api:
        def runs(self, path, filters=None):
            calls.append((path, filters))
            return [fake]

    import wandb

    monkeypatch.setattr(wandb, "Api", Api)
    [remote] = load_wandb("ent/proj", "my-group", progress=False)
    assert calls == [("ent/proj", {"group": "my-group"})]
    assert remote.config == local.config and remote.base_label == local.base_label
    assert remote.source == "wandb:ent/proj/abc123" and remote.events is None
    assert json.dumps(remote.rows, sort_keys=True) == json.dumps(
        local.rows, sort_keys=True
    )  # NaN/inf included, key by key
    flat = run_from_wandb(
        _FakeWandbRun({"objective.preset": "gspo", "routing": {"replay": "off"}, "seed": 3}, [])
    )
    assert flat.base_label == "gspo (replay=off)" and flat.seed == 3  # dotted W&B keys are nested back


def test_report_on_handwritten_runs_links_figures_and_field_tables(hand_sweep, tmp_path):
    """write_report saves every figure as a PNG, the tables, and a report.md that links them all, with a collapse table per varying field."""
    out = tmp_path / "report"
    report = write_report(load_local([hand_sweep], progress=False), out, "hand", [str(hand_sweep)])
    text = report.read_text()
    assert {p.name for p in out.glob("*.png")} == FIGURES
    assert set(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)) == FIGURES
    assert "Collapsed seeds / seeds by `trainer.lr`" in text
    assert "| 0.0001 | 1/2 | 0/1 |" in text and "| 0.0003 | 0/1 | – |" in text


def _drift_run(root: Path, preset: str, seed: int, drift: float, acc: float, change: float, events: int) -> None:
    config = run_config(preset, seed, 1e-4)
    config["routing"]["drift"] = drift
    rows = run_metrics([0.1, 0.1], collapse_last=float(events))
    for row in rows:
        row["routing/expert_change/response_frac"] = row["routing/expert_change/after_one_update"] = change
    rows[-1]["eval/accuracy"] = acc
    kinds = [{"step": 1, "kind": "ratio_blowup", "value": 2e3, "threshold": 1e3}] * events
    write_run(root / f"{preset}-{drift}-{seed}", config, rows, kinds)


def test_drift_sweep_gets_a_dose_table_against_the_replay_arm_and_a_phase_diagram(tmp_path):
    """With routing.drift swept, the report adds a dose table (one row per arm and p, expert change as
    measured, collapse rate with Wilson CI), compares each drifting cell with the replay arm (whose runs
    stand for every p), separates a real effect from noise, and draws phase_diagram.png."""
    from analysis.drift import dose_table, dose_trend

    root = tmp_path / "sweep"
    for seed in range(5):  # the same jitters in another order: equal means, nonzero paired spread
        _drift_run(root, "grpo_rr", seed, 0.0, 0.60 + 0.01 * seed, 0.005, 0)
        _drift_run(root, "grpo", seed, 0.0, 0.60 + 0.01 * (3 * seed % 5), 0.005, 0)
        _drift_run(root, "grpo", seed, 0.2, 0.30 + 0.01 * (2 * seed % 5), 0.12, 1)
    runs = load_local([root], progress=False)
    table = dose_table(group_runs(runs), permutations=1000)
    assert [(r["arm"], r["dose"]) for r in table] == [
        ("grpo (replay=off)", 0.0), ("grpo (replay=off)", 0.2), ("grpo_rr (replay=old)", 0.0)]
    low, high, ref = table
    assert ref["vs_reference"] is None and ref["replay"]
    assert high["expert change"].mean == pytest.approx(0.12) and high["collapsed"] == 5
    assert high["kinds"] == {"ratio_blowup": 5} and high["collapse wilson"][0] > 0.5
    assert high["vs_reference"]["acc"].diff == pytest.approx(-0.30)
    assert high["vs_reference"]["acc verdict"].startswith("distinguishable")
    assert high["vs_reference"]["rate"].diff == pytest.approx(1.0)
    assert low["vs_reference"]["acc"].diff == pytest.approx(0.0, abs=1e-12)
    assert low["vs_reference"]["acc verdict"].startswith("not distinguishable")
    assert high["vs_reference"]["acc"].test == "paired t-test"
    trend = dose_trend(group_runs(runs))["grpo (replay=off)"]
    assert set(trend) == {"final eval acc"}  # no run logged eval/expected_accuracy
    slope, per_seed = trend["final eval acc"]["slope"], trend["final eval acc"]["per_seed"]
    # One slope per seed (its two doses), then a one-sample t over the 5 seeds, not an OLS over 10 runs.
    hand = {s: ((0.30 + 0.01 * (2 * s % 5)) - (0.60 + 0.01 * (3 * s % 5))) / (1.2 - 0.05) for s in range(5)}
    assert per_seed == pytest.approx(hand, rel=1e-9)
    assert slope.diff == pytest.approx(-0.30 / (0.12 - 0.005) * 0.1) and slope.hi < 0 and slope.n_a == 5
    assert slope.p == pytest.approx(sps.ttest_1samp(list(hand.values()), 0.0).pvalue, rel=1e-9)
    out = tmp_path / "report"
    text = write_report(runs, out, "drift", [str(root)], permutations=1000).read_text()
    assert "## Dose-response" in text and "(any: replay wins)" in text and "| arm | drift p |" in text
    assert (out / "phase_diagram.png").read_bytes()[:8] == PNG_MAGIC
    assert "phase_diagram.png" in text and not (out / "dose_table.md").exists()  # report.md holds it
    saved = json.loads((out / "table.json").read_text())
    assert len(saved["dose"]) == 3
    assert saved["dose"][1]["per_seed"]["seed"] == [0, 1, 2, 3, 4]
    assert saved["dose"][1]["per_seed"]["final eval acc"] == pytest.approx([0.30 + 0.01 * (2 * s % 5) for s in range(5)])
    assert saved["dose_trend"]["grpo (replay=off)"]["final eval acc"]["per_seed"] == pytest.approx(
        {str(k): v for k, v in hand.items()}, rel=1e-9)


def test_logit_noise_sweep_is_a_dose_table_on_the_change_after_one_update(tmp_path):
    """With routing.logit_noise swept, the dose table is drawn for σ: its x (the dose trend's and the phase
    diagram's) is the change after one update, and it carries greedy accuracy and the extreme-weight share."""
    from analysis.drift import dose_field, dose_table, dose_trend, format_dose

    root = tmp_path / "sweep"
    for seed in range(5):
        for preset, sigma, acc, after_one in (("grpo_rr", 0.0, 0.6, 0.002), ("grpo", 0.0, 0.6, 0.002),
                                              ("grpo", 0.4, 0.4, 0.12)):  # fmt: skip
            config = run_config(preset, seed, 1e-4)
            config["routing"]["logit_noise"] = sigma
            rows = run_metrics([0.1, 0.1])
            for i, row in enumerate(rows):
                row["routing/expert_change/response_frac"] = 2 * after_one  # later mini-batches see more
                row["routing/expert_change/after_one_update"] = after_one
                row["policy/extreme_weight_share"] = 0.1 * i if sigma else 0.0
            rows[-1]["eval/accuracy"], rows[-1]["eval/accuracy_greedy"] = acc + 0.01 * seed, acc
            write_run(root / f"{preset}-{sigma}-{seed}", config, rows, [])
    runs = load_local([root], progress=False)
    fields = varying_fields(runs)
    assert dose_field(fields) == "routing.logit_noise"
    table = dose_table(group_runs(runs, fields), permutations=100, field="routing.logit_noise")
    assert [(r["arm"], r["field"], r["dose"]) for r in table] == [
        ("grpo (replay=off)", "routing.logit_noise", 0.0), ("grpo (replay=off)", "routing.logit_noise", 0.4),
        ("grpo_rr (replay=old)", "routing.logit_noise", 0.0)]
    high = table[1]
    assert high["change after one update"].mean == pytest.approx(0.12)
    assert high["expert change"].mean == pytest.approx(0.24)
    assert high["final greedy acc"].mean == pytest.approx(0.4)
    assert high["extreme weight share"].mean == pytest.approx(0.05)  # mean over steps of 0.0 and 0.1
    assert high["vs_reference"]["acc"].diff == pytest.approx(-0.2)
    slope = dose_trend(group_runs(runs, fields))["grpo (replay=off)"]["final eval acc"]["slope"]
    assert slope.diff == pytest.approx(-0.2 / (1.2 - 0.02))  # per 10 points of change after one update
    assert "| arm | logit noise σ |" in format_dose(table)
    out = tmp_path / "report"
    text = write_report(runs, out, "noise", [str(root)], permutations=100).read_text()
    assert "## Dose-response" in text and (out / "phase_diagram.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_needs_exactly_one_source(tmp_path):
    """moe-rl-analyze exits with a usage error given both sweep folders and --wandb, neither, or --group alone."""
    for argv in ([str(tmp_path), "--wandb", "e/p"], [], [str(tmp_path), "--group", "g"]):
        with pytest.raises(SystemExit) as err:
            analyze_main([*argv, "--out", str(tmp_path / "out")])
        assert err.value.code == 2


# --- a real sweep --------------------------------------------------------------------------------------

# A fast warm start (few percent accuracy) and a large RL lr: without them every group scores 0, all
# advantages are 0 and every compared metric is exactly 0, so the table check below could not fail.
SWEEP = [
    "objective=grpo,gspo", "seed=0,1", "warmstart.target_low=0.05", "warmstart.target_high=0.9",
    "warmstart.eval_every=5", "warmstart.eval_size=64", "warmstart.batch_size=32", "warmstart.lr=0.01",
    "trainer.steps=2", "trainer.lr=0.01", "trainer.warmup_steps=0", "trainer.prompts_per_step=4",
    "trainer.group_size=4", "trainer.mini_batches=2", "sampler.max_new_tokens=4", "model.num_layers=1",
    "logger.wandb=false", "logger.progress=false", "eval.size=32", "eval.expected_size=32",
]  # fmt: skip
"""A tiny real sweep. Evaluation is cut from 64 sampled and 512 expected-accuracy prompts to 32 each: at the
default sizes evaluation took half of each run's time, and the tests read only that it is logged."""


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory, warm_cache) -> tuple[Path, Path]:
    """A real 2 presets x 2 seeds sweep of moe-rl-train, then moe-rl-analyze on it (both as subprocesses)."""
    tmp = tmp_path_factory.mktemp("analysis")
    sweep, out = tmp / "sweep", tmp / "out"
    train = [sys.executable, "-m", "moe_rl.train", "-m", *SWEEP, f"warmstart.cache_dir={warm_cache}",
             f"hydra.sweep.dir={sweep}"]  # fmt: skip
    subprocess.run(train, cwd=REPO, check=True, capture_output=True, text=True, timeout=900)
    analyze = [sys.executable, "-m", "analysis.cli", str(sweep), "--out", str(out), "--title", "tiny sweep"]
    done = subprocess.run(analyze, cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
    assert "4 runs" in done.stdout
    return sweep, out


def _independent_table(sweep: Path) -> dict[str, dict[str, list[float]]]:
    """Per label (from .hydra/config.yaml), per run: the table's columns computed straight from metrics.jsonl."""

    def mean(values):
        finite = [float(v) for v in values if math.isfinite(float(v))]
        return sum(finite) / len(finite)

    table: dict[str, dict[str, list[float]]] = {}
    for metrics in sorted(sweep.rglob("metrics.jsonl")):
        config = yaml.safe_load((metrics.parent / ".hydra" / "config.yaml").read_text())
        label = f"{config['objective']['preset']} (replay={config['routing']['replay']})"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
        per_run = {
            "final reward": mean([r["rollout/reward/mean"] for r in rows[-5:]]),
            "clip frac": mean([r["clip/token_frac"] for r in rows]),
            "token-ratio var": mean([r["ratio/token/var"] for r in rows]),
            "expert change": mean([r["routing/expert_change/response_frac"] for r in rows]),
            "collapse events": float(rows[-1]["collapse/events"]),
            "final expected acc": [r["eval/expected_accuracy"] for r in rows if "eval/expected_accuracy" in r][-1],
            "seed": config["seed"],
        }
        for key, value in per_run.items():
            table.setdefault(label, {}).setdefault(key, []).append(value)
    return table


def test_real_sweep_figures_are_pngs_linked_from_report(real_sweep):
    """Every figure of a real sweep is a non-trivial PNG, and report.md links each figure and table.json."""
    _, out = real_sweep
    text = (out / "report.md").read_text()
    assert text.startswith("# tiny sweep")
    # Real runs log eval (with expected accuracy, before the first update too) and approx_kl.
    drawn = FIGURES | {"eval_accuracy.png", "clip_vs_kl.png", "expected_accuracy.png"}
    assert {p.name for p in out.glob("*.png")} == drawn
    links = set(re.findall(r"\]\(([^)]+)\)", text))
    assert links == drawn | {"table.json"}
    for name in drawn:
        data = (out / name).read_bytes()
        # Empty axes with a title, labels and a grid are 4.4-5.2 KB as save_png writes them, and hold no
        # coloured pixel; every figure here draws coloured data (the smallest, 7.3 KB).
        assert data[:8] == PNG_MAGIC and len(data) > 5_000, name
        with Image.open(out / name) as image:
            rgb = np.asarray(image.convert("RGB")).astype(int)
        assert ((rgb.max(-1) - rgb.min(-1)) > 60).any(), f"{name}: no coloured pixel, nothing drawn"


def test_real_sweep_table_equals_metrics_recomputed(real_sweep):
    """The summary table (table.json and the markdown cells) equals the per-label seed means recomputed here from each run's metrics.jsonl."""
    sweep, out = real_sweep
    expected = _independent_table(sweep)
    got = json.loads((out / "table.json").read_text())["summary"]
    assert set(got) == set(expected) == {"grpo (replay=off)", "gspo (replay=off)"}
    markdown = first_table(section(out / "report.md", "Summary (mean ± 95% CI over seeds)"))
    header = [c.strip() for c in markdown.splitlines()[0].split("|")]
    nonzero = 0
    for label, columns in expected.items():
        assert sorted(got[label]["seeds"]) == sorted(columns["seed"]) == [0, 1]
        cells = [
            c.strip()
            for c in next(line for line in markdown.splitlines() if line.startswith(f"| {label} |")).split(
                "|"
            )
        ]
        for column in ["final reward", "clip frac", "token-ratio var", "expert change", "collapse events",
                       "final expected acc"]:
            value = sum(columns[column]) / len(columns[column])
            assert got[label][column] == pytest.approx(value, rel=1e-12, abs=0), (label, column)
            assert cells[header.index(column)].startswith(f"{value:.4g} ± "), (label, column)
            nonzero += value != 0
    assert (
        nonzero >= 4
    )  # the check is not vacuous: the warm-started runs have real clip fractions, variances, ...


def test_real_sweep_reports_the_same_from_its_per_run_table_alone(real_sweep, tmp_path):
    """moe-rl-analyze on the sweep's runs.parquet (analysis.runtable) writes the same table.json and eval
    figures, byte for byte, and the same report.md but for its source, the note on what a table leaves out and
    the per-step figures."""
    _, out = real_sweep
    analyze_main([str(out / "runs.parquet"), "--out", str(tmp_path), "--title", "tiny sweep"])
    assert (tmp_path / "table.json").read_bytes() == (out / "table.json").read_bytes()
    assert {p.name for p in tmp_path.glob("*.png")} == {"eval_accuracy.png", "expected_accuracy.png"}
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes() == (out / png.name).read_bytes(), png.name
    ours = (tmp_path / "report.md").read_text()
    assert "Read from per-run tables" in ours
    theirs = (out / "report.md").read_text()
    assert ours.split("\n\n## ")[1:-1] == theirs.split("\n\n## ")[1:-1]  # every section but the figures


def test_real_sweep_collapse_table_counts_seeds_with_events(real_sweep):
    """The collapse table gives, per label, the seeds whose metrics.jsonl ends with collapse/events > 0."""
    sweep, out = real_sweep
    expected = _independent_table(sweep)
    got = json.loads((out / "table.json").read_text())["collapse"]
    for label, columns in expected.items():
        collapsed = sum(events > 0 for events in columns["collapse events"])
        assert (got[label]["seeds"], got[label]["collapsed"]) == (2, collapsed)
        assert got[label]["events"] == sum(columns["collapse events"])


def _length_runs(root: Path) -> None:
    """grpo and gspo, 3 seeds, 2 steps each, logging two populated length bins and an empty third one."""
    for preset, scale in (("grpo", 1.0), ("gspo", 0.5)):
        for seed in range(3):
            rows = run_metrics([0.1, 0.2])
            for step, row in enumerate(rows):
                for b, base in (("1-4", 0.01), ("5-8", 0.04)):
                    row[f"length/{b}/token_var"] = scale * base * (1 + seed) * (1 + step)
                    row[f"length/{b}/within_seq_var"] = scale * base / 2
                    row[f"length/{b}/seq_var"] = "nan" if step == 1 else scale * base / 10
                    row[f"length/{b}/seqs"] = 20.0 + step
                row.update({"length/9-16/token_var": "nan", "length/9-16/within_seq_var": "nan",
                            "length/9-16/seq_var": "nan", "length/9-16/seqs": 0.0})  # fmt: skip
            write_run(root / f"{preset}-{seed}", run_config(preset, seed, 1e-4), rows)


def test_length_variance_figure_from_handwritten_runs(tmp_path, hand_sweep):
    """length_variance.png is drawn from runs that log length/<bin>/*, with each bin's value the mean over
    seeds of the per-seed mean over steps (NaN steps left out) and its Student t CI; an empty bin stays NaN;
    runs without length metrics (or one populated bin) get no figure."""
    from scipy import stats as sps

    from analysis.figures import length_bins_logged, length_variance_stats, plot_length_variance
    from analysis.load import Run

    _length_runs(tmp_path / "length")
    groups = group_runs(load_local([tmp_path / "length"], progress=False))
    assert length_bins_logged([r for runs in groups.values() for r in runs]) == ["1-4", "5-8", "9-16"]
    stats = length_variance_stats(groups)["grpo (replay=off)"]
    per_seed = [0.04 * (1 + seed) * 1.5 for seed in range(3)]  # mean over steps 1x and 2x
    half = sps.t.ppf(0.975, 2) * np.std(per_seed, ddof=1) / math.sqrt(3)
    mean, lo, hi = stats["token_var"]["5-8"]
    assert mean == pytest.approx(np.mean(per_seed)) and hi - mean == pytest.approx(half) and mean - lo == pytest.approx(half)
    assert stats["seq_var"]["1-4"][0] == pytest.approx(0.001)  # the NaN step is left out
    assert stats["seqs"]["5-8"][0] == pytest.approx(20.5)
    assert math.isnan(stats["token_var"]["9-16"][0])
    assert length_variance_stats(groups)["gspo (replay=off)"]["within_seq_var"]["1-4"][0] == pytest.approx(0.0025)
    (tmp_path / "out").mkdir()
    path = plot_length_variance(groups, tmp_path / "out")
    assert path.name == "length_variance.png" and path.read_bytes()[:8] == PNG_MAGIC
    report = write_report(load_local([tmp_path / "length"], progress=False), tmp_path / "report", "len", [])
    assert "length_variance.png" in report.read_text()
    assert plot_length_variance(group_runs(load_local([hand_sweep], progress=False)), tmp_path) is None
    one_bin = {label: [Run(r.config, [{k: v for k, v in row.items() if not k.startswith("length/5-8")}
                                      for row in r.rows], r.events, r.source) for r in runs]
               for label, runs in groups.items()}  # fmt: skip
    assert plot_length_variance(one_bin, tmp_path) is None


def test_drift_report_adds_expected_accuracy_auc_regression_and_per_seed_trend(tmp_path):
    """With eval/expected_accuracy logged, the dose table adds each cell's AUC, its paired difference to the
    replay arm and a log-rank test of time to regression; the trend gets a per-seed AUC slope."""
    from analysis.drift import dose_table, dose_trend, format_dose
    from analysis.outcomes import auc

    root = tmp_path / "sweep"
    for seed in range(5):
        for preset, drift, final in (("grpo_rr", 0.0, 0.6), ("grpo", 0.0, 0.6), ("grpo", 0.2, 0.2)):
            _drift_run(root, preset, seed, drift, 0.5, 0.005 if drift == 0 else 0.12, 0)
            folder = root / f"{preset}-{drift}-{seed}"
            rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
            rows[0]["eval/initial/expected_accuracy"] = 0.5
            rows[0]["eval/expected_accuracy"], rows[1]["eval/expected_accuracy"] = final + 0.01 * seed, final
            (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    groups = group_runs(load_local([root], progress=False))
    low, high, ref = dose_table(groups, permutations=100)
    hand_auc = [(0.5 * (0.5 + 0.2 + 0.01 * s) + 0.5 * (0.4 + 0.01 * s)) / 2 for s in range(5)]
    assert high["per_seed"]["expected-acc AUC"] == pytest.approx(hand_auc, rel=1e-12)
    assert high["expected-acc AUC"].mean == pytest.approx(np.mean(hand_auc), rel=1e-12)
    assert high["vs_reference"]["auc"].diff == pytest.approx(np.mean(hand_auc) - np.mean(
        [auc(r) for r in groups["grpo_rr (replay=old) drift=0"]]), rel=1e-9)
    reg = high["vs_reference"]["regression"]
    assert (reg["regressed_a"], reg["n_a"], reg["regressed_b"], reg["n_b"]) == (5, 5, 0, 5) and reg["p"] < 0.05
    assert low["vs_reference"]["regression"]["regressed_a"] == 0
    trend = dose_trend(groups)["grpo (replay=off)"]["expected-acc AUC"]
    assert trend["slope"].n_a == 5 and trend["slope"].diff < 0
    text = format_dose([low, high, ref])
    assert "| expected-acc AUC |" in text and "| Δ expected-acc AUC | verdict | time to regression |" in text
    assert "regressed 5/5 vs 0/5" in text


def test_step_table_averages_change_and_kl_per_run_then_over_seeds(tmp_path):
    """The volatility and step-size table: per run the mean over steps of the change after one update, its
    margin prediction, the per-update KL and the load CV; then mean ± t-CI over seeds (float64 reference by hand)."""
    from analysis.report import format_step, step_table

    root = tmp_path / "sweep"
    per_run = {}
    for seed in range(3):
        rows = run_metrics([0.1, 0.1, 0.1])
        for i, row in enumerate(rows):
            row["routing/expert_change/after_one_update"] = 0.01 * (seed + 1) * (i + 1)
            row["policy/approx_kl"] = 1e-3 * (seed + i)
            row["routing/load_cv/mean"] = 0.5 + 0.1 * seed + 0.2 * i
        write_run(root / f"r{seed}", run_config("grpo", seed, 1e-4), rows)
        per_run[seed] = (0.02 * (seed + 1), 1e-3 * (seed + 1))
    table = step_table(group_runs(load_local([root], progress=False)))
    (row,) = table.values()
    changes = [c for c, _ in per_run.values()]
    half = sps.t.ppf(0.975, 2) * np.std(changes, ddof=1) / np.sqrt(3)
    assert row["change after one update"] == pytest.approx(np.mean(changes), rel=1e-12)
    assert row["ci95"]["change after one update"] == pytest.approx(half, rel=1e-9)
    assert row["per-update KL"] == pytest.approx(np.mean([k for _, k in per_run.values()]), rel=1e-12)
    assert row["load CV"] == pytest.approx(np.mean([0.5 + 0.1 * seed + 0.2 for seed in range(3)]), rel=1e-12)
    assert math.isnan(row["change predicted by the margins"])  # not logged by these runs
    assert "| 3 | 4.00% ± " in format_step(table)


def _copies(groups: dict, n: int) -> dict:
    """n groups, each the runs of the first group (a wide sweep without writing n sets of runs)."""
    runs = next(iter(groups.values()))
    return {f"arm {i:02d}": runs for i in range(n)}


@pytest.mark.parametrize("n", [1, 8, 9, 20])
def test_length_variance_draws_a_panel_per_group_up_to_the_limit_then_one_panel_per_variance(tmp_path, monkeypatch, n):
    """Up to MAX_GROUP_PANELS (8) groups length_variance.png has one panel per group, titled by it; above, one
    panel per variance (3, whatever the count), each with one error-bar line per group."""
    import analysis.figures as figures
    from analysis.plotting import MAX_GROUP_PANELS

    _length_runs(tmp_path / "length")
    groups = _copies(group_runs(load_local([tmp_path / "length"], progress=False)), n)
    drawn = []
    monkeypatch.setattr(figures, "finish", lambda fig, axes, path, title: drawn.append(axes) or path)
    figures.plot_length_variance(groups, tmp_path)
    (axes,) = drawn
    titles = [ax.get_title() for ax in axes]
    if n <= MAX_GROUP_PANELS:
        assert titles == list(groups) and all(len(ax.containers) == 3 for ax in axes)
    else:
        assert titles == [name for name, _, _ in figures.LENGTH_VARIANCES.values()]
        assert all(len(ax.containers) == n for ax in axes)


def test_figures_are_palette_pngs_at_the_set_dpi(tmp_path):
    """save_png writes an 8-bit palette PNG whose size in pixels is the figure's inches (and matplotlib's
    tight-bbox padding) times DPI."""
    from PIL import Image

    from analysis.plotting import DPI, plt, save_png

    fig = plt.figure(figsize=(4, 3))
    fig.add_artist(plt.Line2D([0, 1], [0, 1]))  # reaches the corners, so bbox_inches="tight" keeps the size
    with Image.open(save_png(fig, tmp_path / "f.png")) as image:
        pad = 2 * plt.rcParams["savefig.pad_inches"]
        assert image.mode == "P" and image.size == (round((4 + pad) * DPI), round((3 + pad) * DPI))


def test_a_section_added_to_the_registry_appears_in_every_output(hand_sweep, tmp_path):
    """A Section passed to write_report writes its table.json entry, its heading, intro and tables in
    report.md (and a file of its own only when report.md shows something else) and links its figure; one
    whose applies is false leaves no trace."""
    from analysis.plotting import plt, save_png
    from analysis.report import SECTIONS
    from analysis.sections import Section

    def figure(result, out_dir):
        fig = plt.figure(figsize=(2, 2))
        return {"seed_count": (save_png(fig, out_dir / "seed_count.png"), "Runs per sweep.")}

    extra = Section(name="seed_count", heading="Seeds", intro="How many runs.", file="seeds.md",
                    compute=lambda sweep: len(sweep.runs), markdown=lambda n: f"{n} runs", figures=figure)
    never = Section(name="never", heading="Never", compute=lambda sweep: 1, markdown=str, file="never.md",
                    applies=lambda sweep: False)
    short = Section(name="short", heading="Short", compute=lambda sweep: 2, markdown=lambda n: f"{n} in full",
                    file="short.md", body=lambda n: f"{n} in short")
    runs = load_local([hand_sweep], progress=False)
    text = write_report(runs, tmp_path / "out", "t", [], sections=(*SECTIONS, extra, never, short)).read_text()
    assert not (tmp_path / "out" / "seeds.md").exists()  # report.md shows its tables
    assert (tmp_path / "out" / "short.md").read_text() == "2 in full\n" and "## Short\n\n2 in short" in text
    assert json.loads((tmp_path / "out" / "table.json").read_text())["seed_count"] == 4
    assert "## Seeds\n\nHow many runs.\n\n4 runs\n\n## Short" in text and "![seed_count](seed_count.png)" in text
    assert "Never" not in text and not (tmp_path / "out" / "never.md").exists()


def test_a_record_is_data_its_interpolations_are_never_resolved(tmp_path, monkeypatch):
    """A record's .hydra/config.yaml holding ${oc.env:NAME} or a custom resolver (an archive from elsewhere)
    is read as written, with one warning naming the keys: the analyst's environment variable reaches neither
    the loaded config nor report.md / table.json, and an unknown resolver does not stop the analysis."""
    from omegaconf import OmegaConf

    monkeypatch.setenv("MOE_RL_TEST_SECRET", "s3cr3t-value")
    if not OmegaConf.has_resolver("moe_rl_test_leak"):
        OmegaConf.register_new_resolver("moe_rl_test_leak", lambda: "resolved-by-analyst")
    root = tmp_path / "sweep"
    for seed in (0, 1):
        config = run_config("grpo", seed, 1e-4)
        config["logger"]["group"] = "${oc.env:MOE_RL_TEST_SECRET}"
        config["experiment"] = "${moe_rl_test_leak:}"
        if seed == 1:  # an unknown resolver too (run 0 has only resolvable ones, which a resolve would leak)
            config["trainer"]["tag"] = "${no_such_resolver:x}"
        write_run(root / f"run{seed}", config, run_metrics([0.1, 0.2]))
    with pytest.warns(RuntimeWarning, match=r"logger\.group.*kept as written"):
        run = read_local_run(root / "run0")
    assert run.config["logger"]["group"] == "${oc.env:MOE_RL_TEST_SECRET}"
    assert run.config["experiment"] == "${moe_rl_test_leak:}"
    out = tmp_path / "report"
    analyze_main([str(root), "--out", str(out), "--no-progress"])
    written = "".join(p.read_text() for p in out.iterdir() if p.suffix in (".md", ".json"))
    assert "s3cr3t-value" not in written and "resolved-by-analyst" not in written
