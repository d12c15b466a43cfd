"""analysis.steplr: each objective at its own step size, against float64 references written out here."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats as sps

from analysis.load import load_local
from analysis.report import write_report
from analysis.steplr import (
    arms_from_table,
    in_sample_best,
    lr_at_kl,
    matched_kl,
    own_lr,
    shared_lr,
    steplr_table,
)

REPO = Path(__file__).resolve().parents[3]
LRS = [1e-4, 2e-4, 4e-4, 8e-4]


def _t_reference(d: list[float]) -> tuple[float, float, float, float]:
    """(mean, lo, hi, p) of a one-sample t over d, by explicit sums."""
    n = len(d)
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) / math.sqrt(n)
    half = sps.t.ppf(0.975, n - 1) * se
    return mean, mean - half, mean + half, 2 * sps.t.sf(abs(mean) / se, n - 1)


def _grid(fn, seeds=range(6)) -> dict[float, dict[int, float]]:
    return {lr: {s: float(fn(lr, s)) for s in seeds} for lr in LRS}


def test_shared_lr_is_the_paired_t_at_each_lr():
    """At each lr the contrast is the paired t over seeds of a - b (loop reference)."""
    rng = np.random.default_rng(1)
    a, b = _grid(lambda lr, s: rng.normal()), _grid(lambda lr, s: rng.normal())
    for lr, d in shared_lr(a, b).items():
        ref = _t_reference([a[lr][s] - b[lr][s] for s in range(6)])
        assert (d.diff, d.lo, d.hi, d.p) == pytest.approx(ref, rel=1e-10)


def test_own_lr_chooses_on_one_half_and_evaluates_on_the_other():
    """Cross-fitting: best lr by mean over seeds {0,2,4} scores seeds {1,3,5} and vice versa; paired t over all six."""
    rng = np.random.default_rng(2)
    a = _grid(lambda lr, s: -((math.log10(lr) + 3.6) ** 2) + 0.05 * rng.normal())
    b = _grid(lambda lr, s: -((math.log10(lr) + 3.3) ** 2) + 0.05 * rng.normal())
    d, folds = own_lr(a, b)
    diffs = {}
    for tune, ev in (([0, 2, 4], [1, 3, 5]), ([1, 3, 5], [0, 2, 4])):
        la = max(LRS, key=lambda lr: sum(a[lr][s] for s in tune))
        lb = max(LRS, key=lambda lr: sum(b[lr][s] for s in tune))
        diffs.update({s: a[la][s] - b[lb][s] for s in ev})
    assert [f["tune"] for f in folds] == [[0, 2, 4], [1, 3, 5]]
    ref = _t_reference([diffs[s] for s in sorted(diffs, key=lambda s: (s % 2 == 0, s))])
    assert (d.diff, d.lo, d.hi, d.p) == pytest.approx(ref, rel=1e-10)
    assert d.n_a == 6


def test_cross_fitting_removes_the_winners_curse_that_in_sample_choice_has():
    """Null sweeps (no lr or arm effect; arm a noisier): in-sample choice inflates a - b, cross-fitting does not."""
    rng = np.random.default_rng(0)
    naive, crossed = [], []
    for _ in range(1500):
        a = _grid(lambda lr, s: 0.05 * rng.normal())
        b = _grid(lambda lr, s: 0.01 * rng.normal())
        naive.append(in_sample_best(a, b)[0].diff)
        crossed.append(own_lr(a, b)[0].diff)
    se_naive = np.std(naive) / math.sqrt(len(naive))
    se_crossed = np.std(crossed) / math.sqrt(len(crossed))
    assert np.mean(naive) > 10 * se_naive  # the max of four noisy means is biased upward
    assert abs(np.mean(crossed)) < 3.5 * se_crossed


def test_matched_kl_interpolates_lr_on_log_kl_and_outcome_on_log_lr():
    """KL = c·lr² and outcomes linear in log10 lr: the matched-KL lr and contrast equal their closed forms."""
    ca, cb = 1e5, 4e5  # b reaches a KL at half a's lr
    a_kl = _grid(lambda lr, s: ca * lr**2 * (1 + 0.01 * s))
    b_kl = _grid(lambda lr, s: cb * lr**2 * (1 + 0.01 * s))
    a = _grid(lambda lr, s: 0.3 + 0.1 * math.log10(lr) + 0.01 * s)
    b = _grid(lambda lr, s: 0.2 + 0.05 * math.log10(lr) + 0.02 * s * s)
    seeds = list(range(6))
    scale = np.mean([1 + 0.01 * s for s in seeds])
    kappa = ca * (3e-4) ** 2 * scale
    assert lr_at_kl(a_kl, kappa, seeds) == pytest.approx(3e-4, rel=1e-12)
    assert math.isnan(lr_at_kl(a_kl, ca * 1e-2 * scale, seeds))  # beyond the largest lr: no extrapolation
    rows = matched_kl(a, a_kl, b, b_kl)
    assert [r["at_lr"] for r in rows] == LRS[1:3]  # the geometric-mean KLs at 1e-4 and 8e-4 leave one arm's range
    for r in rows:
        la, lb = math.sqrt(r["kl"] / (ca * scale)), math.sqrt(r["kl"] / (cb * scale))
        assert (r["lr_a"], r["lr_b"]) == pytest.approx((la, lb), rel=1e-10)
        d = [(0.3 + 0.1 * math.log10(la) + 0.01 * s) - (0.2 + 0.05 * math.log10(lb) + 0.02 * s * s) for s in seeds]
        ref = _t_reference(d)
        diff = r["difference"]
        assert (diff.diff, diff.lo, diff.hi, diff.p) == pytest.approx(ref, rel=1e-9)


def test_committed_critical_lr_table_gives_the_own_lr_contrast_recomputed_from_its_per_seed_aucs():
    """docs/results/critical_lr: GRPO − GSPO at zero noise, own lr cross-fitted, recomputed from table.json by hand."""
    table = json.loads((REPO / "docs/results/critical_lr/table.json").read_text())
    rows = {(r["a"], r["b"]): r for r in steplr_table(*arms_from_table(table))}
    row = rows[("grpo (replay=off) logit_noise=0", "gspo (replay=off) logit_noise=0")]
    auc = {}
    for label, o in table["outcomes"].items():
        arm, lr = label.rsplit(" lr=", 1)
        auc.setdefault(arm, {})[float(lr)] = dict(zip(o["per_seed"]["seed"], o["per_seed"]["auc"], strict=True))
    a, b = auc["grpo (replay=off) logit_noise=0"], auc["gspo (replay=off) logit_noise=0"]
    diffs = []
    for tune, ev in (([0, 2], [1, 3]), ([1, 3], [0, 2])):
        la = max(a, key=lambda lr: sum(a[lr][s] for s in tune))
        lb = max(b, key=lambda lr: sum(b[lr][s] for s in tune))
        diffs += [a[la][s] - b[lb][s] for s in ev]
    ref = _t_reference(diffs)
    own = row["own_lr"]
    assert (own["diff"], own["lo"], own["hi"], own["p"]) == pytest.approx(ref, rel=1e-10)
    assert own["n"] == 4 and own["verdict"].startswith("no verdict possible")


def _run(root: Path, preset: str, lr: float, seed: int, acc: float, kl: float, build: int = 0) -> None:
    cfg = {"objective": {"name": preset, "preset": preset}, "routing": {"replay": "off"}, "trainer": {"lr": lr},
           "model": {"seed": 0}, "warmstart": {"enabled": True, "build_seed": build, "seed": 0}, "seed": seed,
           "experiment": "hand"}  # fmt: skip
    folder = root / f"{preset}-{lr}-{build}-{seed}"
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"step": s, "rollout/reward/mean": acc, "clip/token_frac": 0.1, "ratio/token/var": 0.01 * (s + 1),
             "ratio/token/within_seq_var": 0.001, "rollout/response_len/mean": 3.0 + s,
             "routing/expert_change/frac": 0.01, "time/step_s": 1.0, "eval/accuracy": acc, "policy/approx_kl": kl}
            for s in range(3)]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "events.jsonl").write_text("")
    summary = {"label": f"{preset} (replay=off)", "objective": preset, "replay": "off", "seed": seed,
               "experiment": "hand"}
    (folder / "summary.json").write_text(json.dumps(summary))


def test_report_of_an_lr_sweep_has_the_own_lr_section_and_table(tmp_path):
    """Three lrs x two objectives: report.md gets the own-lr section and table.json the same contrasts."""
    rng = np.random.default_rng(5)
    for lr in (1e-4, 2e-4, 4e-4):
        for s in range(4):
            _run(tmp_path / "sweep", "grpo", lr, s, 0.2 + 1000 * lr + 0.01 * rng.normal(), 10 * lr)
            _run(tmp_path / "sweep", "gspo", lr, s, 0.8 - 1000 * lr + 0.01 * rng.normal(), 20 * lr)
    runs = load_local([tmp_path / "sweep"], progress=False)
    report = write_report(runs, tmp_path / "out", "t", ["sweep"])
    (row,) = json.loads((tmp_path / "out" / "table.json").read_text())["own_lr"]
    assert (row["a"], row["b"], row["outcome"]) == ("grpo (replay=off)", "gspo (replay=off)", "final eval accuracy")
    assert [(f["lr_a"], f["lr_b"]) for f in row["own_lr"]["folds"]] == [(4e-4, 1e-4)] * 2
    assert len(row["shared"]) == 3 and row["matched_kl"]
    assert "## Each objective at its own step size" in report.read_text()


def test_clustered_own_lr_chooses_on_half_the_warm_starts_and_judges_over_the_others():
    """4 warm starts x 3 seeds: folds split warm starts ({0, 2} tune, {1, 3} scored, then swapped); the
    estimate is the t over warm starts of the scored units' paired differences (loop reference)."""
    from analysis.steplr import compare_arms_clustered

    rng = np.random.default_rng(9)
    units = [f"w{w}/s{s}" for w in range(4) for s in range(3)]
    cluster_of = {u: u.split("/")[0] for u in units}
    shift = {f"w{w}": 0.05 * rng.normal() for w in range(4)}  # a warm start's own offset, shared by its seeds
    a = {lr: {u: -((math.log10(lr) + 3.6) ** 2) + shift[cluster_of[u]] + 0.02 * rng.normal() for u in units}
         for lr in LRS}  # fmt: skip
    b = {lr: {u: -((math.log10(lr) + 3.3) ** 2) + 0.02 * rng.normal() for u in units} for lr in LRS}
    row = compare_arms_clustered(a, b, None, None, cluster_of)
    assert [(f["tune"], f["evaluate"]) for f in row["own_lr"]["folds"]] == [(["w0", "w2"], ["w1", "w3"]),
                                                                           (["w1", "w3"], ["w0", "w2"])]
    means = {}
    for tune_w, eval_w in ((["w0", "w2"], ["w1", "w3"]), (["w1", "w3"], ["w0", "w2"])):
        tune = [u for u in units if cluster_of[u] in tune_w]
        la = max(LRS, key=lambda lr: sum(a[lr][u] for u in tune))
        lb = max(LRS, key=lambda lr: sum(b[lr][u] for u in tune))
        for w in eval_w:
            d = [a[la][u] - b[lb][u] for u in units if cluster_of[u] == w]
            means[w] = sum(d) / len(d)
    ref = _t_reference([means[w] for w in sorted(means)])
    own = row["own_lr"]
    assert (own["diff"], own["lo"], own["hi"], own["p"]) == pytest.approx(ref, rel=1e-10)
    assert own["n"] == 4 and own["test"] == "t over warm starts"


def test_report_of_an_lr_sweep_over_warm_starts_judges_own_lr_over_warm_starts(tmp_path):
    """4 warm starts x 2 seeds x 3 lrs x 2 objectives: the own-lr rows are t's over 4 warm starts."""
    rng = np.random.default_rng(6)
    for build in range(4):
        for lr in (1e-4, 2e-4, 4e-4):
            for s in range(2):
                _run(tmp_path / "sweep", "grpo", lr, s, 0.2 + 1000 * lr + 0.01 * rng.normal(), 10 * lr, build)
                _run(tmp_path / "sweep", "gspo", lr, s, 0.8 - 1000 * lr + 0.01 * rng.normal(), 20 * lr, build)
    runs = load_local([tmp_path / "sweep"], progress=False)
    write_report(runs, tmp_path / "out", "t", ["sweep"])
    (row,) = json.loads((tmp_path / "out" / "table.json").read_text())["own_lr"]
    assert row["own_lr"]["n"] == 4 and row["own_lr"]["test"] == "t over warm starts"
    assert [(f["lr_a"], f["lr_b"]) for f in row["own_lr"]["folds"]] == [(4e-4, 1e-4)] * 2
    assert all(r["n"] == 4 for r in row["shared"].values()) and row["matched_kl"]
