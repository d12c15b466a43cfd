"""The vLLM-against-hf analysis (analysis/engines.py): cells read from configs, per-engine means over steps
and the vLLM − hf differences paired by seed, against float64 references; and the report section."""

import numpy as np
import pytest
from scipy import stats as sps

from analysis.engines import applies, engine_table, format_engines
from analysis.load import Run
from analysis.report import write_report
from tests.helpers.report_text import first_table, section

PRESETS = {"grpo": "off", "grpo_r3": "rollout"}


def _run(preset: str, engine: str, dtype, seed: int, mismatch: list[float], acc: float) -> Run:
    rows = [{"step": s, "mismatch/logp_abs_diff/mean": m, "routing/rollout_vs_old/frac": 0.001 * s,
             "rollout/reward/mean": 0.5, "time/step_s": 1.0} for s, m in enumerate(mismatch)]  # fmt: skip
    if engine == "vllm":
        for row in rows:
            row["time/weight_sync_s"] = 0.05
    rows[-1]["eval/accuracy"] = acc
    config = {"objective": {"preset": preset}, "seed": seed, "routing": {"replay": PRESETS[preset]},
              "sampler": {"engine": engine}, "trainer": {"sampler_dtype": dtype}}  # fmt: skip
    return Run(config, rows, [], f"{preset}-{engine}-{dtype}-{seed}")


def _sweep(rng):
    runs, values = [], {}
    for preset in PRESETS:
        for dtype in (None, "bfloat16"):
            for engine in ("hf", "vllm"):
                for seed in range(5):
                    mismatch = list(rng.uniform(0, 0.01, size=4))
                    acc = float(rng.uniform(0.3, 0.6))
                    values[preset, dtype, engine, seed] = (np.mean(mismatch), acc)
                    runs.append(_run(preset, engine, dtype, seed, mismatch, acc))
    return runs, values


def test_paired_differences_against_float64_references():
    """Each cell's vLLM − hf mismatch and final-accuracy differences are the paired t of the per-seed
    values (scipy, float64), and the means over steps are the runs' own."""
    runs, values = _sweep(np.random.default_rng(0))
    assert applies(runs) and not applies([r for r in runs if r.flat["sampler.engine"] == "hf"])
    table = engine_table(runs)
    assert [(r["arm"], r["precision"]) for r in table] == [
        (f"{p} (replay={PRESETS[p]})", d) for p in sorted(PRESETS) for d in ("bf16", "fp32")]
    for row in table:
        preset = row["arm"].split(" ")[0]
        dtype = "bfloat16" if row["precision"] == "bf16" else None
        for name, index in (("mismatch", 0), ("final eval acc", 1)):
            v = np.array([values[preset, dtype, "vllm", s][index] for s in range(5)], dtype=np.float64)
            h = np.array([values[preset, dtype, "hf", s][index] for s in range(5)], dtype=np.float64)
            d = row["outcomes"][name]["diff"]
            assert d.diff == pytest.approx((v - h).mean(), abs=1e-12)
            assert d.p == pytest.approx(sps.ttest_rel(v, h).pvalue, rel=1e-9)
            half = sps.t.ppf(0.975, 4) * (v - h).std(ddof=1) / np.sqrt(5)
            assert (d.lo, d.hi) == pytest.approx(((v - h).mean() - half, (v - h).mean() + half), abs=1e-12)
        sync = row["outcomes"]["weight sync (s)"]
        assert sync["vllm"]["mean_ci"].mean == pytest.approx(0.05) and sync["diff"] is None  # hf logs none
    md = format_engines(table)
    assert md.count("\n| grpo") == 4 and "mismatch: vLLM − hf" in md


def test_report_has_the_engine_section(tmp_path):
    """moe-rl-analyze's report carries the section when the sweep crosses both engines."""
    runs, _ = _sweep(np.random.default_rng(1))
    report = write_report(runs, tmp_path, "t", ["synthetic"], permutations=100)
    assert "## vLLM engine against hf engine" in report.read_text()
    assert first_table(section(report, "vLLM engine against hf engine")).count("\n") >= 2  # header, rule, rows
