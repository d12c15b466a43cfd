"""The replay-against-off-policiness analysis (analysis/offpolicy.py): sources read from configs, paired
contrasts and their trends over mini-batches recovered exactly from runs of known AUC, and the report."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from analysis.load import Run
from analysis.offpolicy import applies, format_offpolicy, offpolicy_table, offpolicy_trends, source
from analysis.report import write_report
from tests.helpers.report_text import section

PRESETS = {"off": ("grpo", "off"), "R2": ("grpo_rr", "old"), "R3": ("grpo_r3", "rollout"), "TIS": ("grpo_tis", "off")}


def _run(arm: str, m: int, seed: int, value: float, dtype=None, sigma=0.0, scope="update") -> Run:
    """A run whose expected accuracy is `value` at every eval (so its AUC is `value`), 2 s per step."""
    preset, replay = PRESETS[arm]
    rows = [{"step": 0, "eval/initial/expected_accuracy": value, "time/step_s": 2.0, "time/eval_s": 1.0,
             "mismatch/logp_abs_diff/mean": 0.004 if dtype else 0.0}]
    rows += [{"step": s, "eval/expected_accuracy": value, "time/step_s": 2.0, "mismatch/logp_abs_diff/mean": 0.0}
             for s in range(1, 4)]  # fmt: skip
    config = {"objective": {"preset": preset}, "seed": seed,
              "routing": {"replay": replay, "logit_noise": sigma, "noise_scope": scope},
              "trainer": {"mini_batches": m, "sampler_dtype": dtype, "lr": 1e-4}}  # fmt: skip
    return Run(config, rows, [], f"{arm}-{m}-{seed}-{dtype}-{sigma}")


def test_source_names_the_mismatch():
    assert source(_run("off", 1, 0, 0.5)) == "none"
    assert source(_run("off", 1, 0, 0.5, dtype="bfloat16")) == "bf16 sampler"
    assert source(_run("off", 1, 0, 0.5, sigma=0.3, scope="trainer")) == "trainer noise σ=0.3"
    # noise in the update forwards only is volatility, not a sampler/trainer mismatch
    assert source(_run("off", 1, 0, 0.5, sigma=0.3)) == "none"


# AUC = 0.4 + seed offset + arm effect at M; R3 - R2 grows by 0.01 per doubling of M, R2 - off by 0.02.
EFFECT = {"off": lambda k: 0.0, "R2": lambda k: 0.02 * k, "R3": lambda k: 0.03 * k, "TIS": lambda k: 0.005}
MS, SEEDS = (1, 2, 4, 8), range(5)


def _sweep(rng) -> tuple[list[Run], dict]:
    runs, noise = [], {}
    for m in MS:
        for arm in PRESETS:
            for seed in SEEDS:
                noise[arm, m, seed] = rng.normal(0, 0.01)
                value = 0.4 + 0.05 * seed + EFFECT[arm](math.log2(m)) + noise[arm, m, seed]
                runs.append(_run(arm, m, seed, value, dtype="bfloat16"))
    return runs, noise


def test_contrasts_and_trends_against_float64_references():
    runs, noise = _sweep(np.random.default_rng(0))
    table = offpolicy_table(runs)
    assert [(r["source"], r["mini_batches"]) for r in table] == [("bf16 sampler", m) for m in MS]
    for row in table:
        k = math.log2(row["mini_batches"])
        for name, c in row["contrasts"].items():
            a, b = name.split(" - ")
            diffs = [EFFECT[a](k) - EFFECT[b](k) + noise[a, row["mini_batches"], s] - noise[b, row["mini_batches"], s]
                     for s in SEEDS]  # fmt: skip
            ref = sps.ttest_1samp(diffs, 0.0)
            half = sps.t.ppf(0.975, len(diffs) - 1) * np.std(diffs, ddof=1) / math.sqrt(len(diffs))
            assert c["diff"].diff == pytest.approx(np.mean(diffs), abs=1e-12)
            assert c["diff"].hi - c["diff"].diff == pytest.approx(half, rel=1e-9)
            assert c["diff"].p == pytest.approx(ref.pvalue, rel=1e-9)
            assert c["diff"].n_a == 5
        assert row["arms"]["off"]["cost_s"].mean == pytest.approx(4 * 2.0 + 1.0)
        assert row["arms"]["off"]["mismatch"].mean == pytest.approx(0.001)
    trends = offpolicy_trends(runs)["bf16 sampler"]
    for name, slope in (("R2 - off", 0.02), ("R3 - R2", 0.01), ("R3 - off", 0.03)):
        per_seed = []
        for s in SEEDS:
            y = [EFFECT[name[:2]](math.log2(m)) - EFFECT[name[5:]](math.log2(m))
                 + noise[name[:2], m, s] - noise[name[5:], m, s] for m in MS]  # fmt: skip
            per_seed.append(np.polyfit(np.log2(MS), y, 1)[0])
        t = trends[name]
        assert t["per_seed"] == pytest.approx(dict(zip(SEEDS, per_seed, strict=True)), abs=1e-12)
        assert t["slope"].diff == pytest.approx(np.mean(per_seed), abs=1e-12)
        assert t["slope"].p == pytest.approx(sps.ttest_1samp(per_seed, 0.0).pvalue, rel=1e-9)
        assert t["slope"].diff == pytest.approx(slope, abs=0.012)  # the known slope, within 4 standard errors
    md = format_offpolicy(table, offpolicy_trends(runs))
    assert "| bf16 sampler | 8 | R3 - R2 | 5 |" in md


def test_report_reads_an_offpolicy_sweep_and_skips_the_dose_table(tmp_path):
    """Trainer-scope noise varies routing.logit_noise, but R2 is not immune to it, so no dose table (whose
    reference is the replay arm) is drawn; the off-policiness section is."""
    runs = [_run(arm, m, s, 0.4 + 0.01 * s, sigma=sigma, scope="trainer")
            for arm in ("off", "R2", "R3") for m in (1, 4) for s in range(3) for sigma in (0.0, 0.3)]  # fmt: skip
    assert applies(runs)
    assert not applies([r for r in runs if r.flat["trainer.mini_batches"] == 1])
    assert not applies([r for r in runs if r.base_label != "grpo_rr (replay=old)"])
    report = write_report(runs, tmp_path, "t", ["x"], permutations=100).read_text()
    assert "## Replay against off-policiness" in report and "## Dose-response" not in report
    assert (tmp_path / "offpolicy.png").is_file()
    assert "| trainer noise σ=0.3 | 4 | R3 - R2 | 3 |" in section(report, "Replay against off-policiness")
