"""The critical-step-size analysis: Firth's logistic regression against float64 references, and the
critical lr and its dose shift recovered from runs drawn from a known model."""

import math

import numpy as np
import pytest
from scipy import optimize, special

from analysis.critical import critical_lr, firth_logistic, format_critical, regressed
from analysis.load import Run, varying_fields
from analysis.report import write_report
from tests.helpers.report_text import first_table, section


def _penalised_nll(beta, X, y):
    eta = X @ beta
    p = special.expit(eta)
    fisher = X.T @ ((p * (1 - p))[:, None] * X)
    return -(np.sum(y * eta - np.logaddexp(0, eta)) + 0.5 * np.linalg.slogdet(fisher)[1])


def test_firth_intercept_only_has_its_closed_form():
    """An intercept-only Firth fit is logit((k + 1/2) / (n + 1)), even with no event or all events."""
    for k, n in ((0, 10), (3, 10), (10, 10), (1, 4)):
        fit = firth_logistic(np.ones((n, 1)), np.r_[np.ones(k), np.zeros(n - k)])
        assert fit.converged
        assert fit.beta[0] == pytest.approx(math.log((k + 0.5) / (n - k + 0.5)), abs=1e-9)


def test_firth_maximises_the_penalised_likelihood_under_separation():
    """On completely separated data (where plain maximum likelihood diverges) the fit is finite and equals
    a direct float64 optimisation of l(β) + ½ log det I(β); its covariance is I(β)⁻¹."""
    x = np.log10([1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3]).repeat(4)
    X = np.c_[np.ones_like(x), x - x.mean()]
    y = (x > np.log10(3e-4)).astype(float)  # regress at every lr above 3e-4, never below
    fit = firth_logistic(X, y)
    ref = optimize.minimize(_penalised_nll, np.zeros(2), args=(X, y), method="BFGS", options={"gtol": 1e-12})
    assert fit.converged and np.all(np.isfinite(fit.beta)) and fit.beta[1] > 0
    assert _penalised_nll(fit.beta, X, y) <= ref.fun + 1e-12
    assert fit.beta == pytest.approx(ref.x, abs=1e-5)
    p = special.expit(X @ fit.beta)
    assert fit.cov == pytest.approx(np.linalg.inv(X.T @ ((p * (1 - p))[:, None] * X)), rel=1e-9)


def _run(arm: str, replay: str, lr: float, sigma: float, seed: int, falls: bool) -> Run:
    """A run whose expected accuracy stays at 0.5, or falls to 0.1 at its last two evals."""
    values = [0.5, 0.5, 0.1, 0.1] if falls else [0.5] * 4
    rows = [{"step": 0, "eval/initial/expected_accuracy": 0.5}] + [
        {"step": 10 * i + 9, "eval/expected_accuracy": v} for i, v in enumerate(values)]
    rows[0]["eval/expected_accuracy"] = 0.5
    config = {"objective": {"preset": arm}, "routing": {"replay": replay, "logit_noise": sigma},
              "trainer": {"lr": lr}, "seed": seed}  # fmt: skip
    return Run(config, rows, [], f"{arm}-{lr}-{sigma}-{seed}")


LRS = [1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3]


def _draw(star: dict[tuple[str, float], float], slope: float, seeds: int, rng) -> list[Run]:
    runs = []
    for (arm, sigma), lr_star in star.items():
        replay = "old" if arm == "grpo_rr" else "off"
        for lr in LRS:
            p = special.expit(slope * (math.log10(lr) - math.log10(lr_star)))
            runs += [_run(arm, replay, lr, sigma, s, bool(rng.random() < p)) for s in range(seeds)]
    return runs


def test_critical_lr_recovers_a_known_dose_shift_and_its_interaction():
    """Runs drawn from P(regress) = σ(b (log10 lr − log10 lr*)) with lr* halved by the dose for grpo only:
    the fit places each lr* within its interval, finds grpo's shift (x0.5) distinguishable from none and
    gspo's not, and the difference between them distinguishable."""
    truth = {("grpo", 0.0): 6e-4, ("grpo", 0.3): 3e-4, ("gspo", 0.0): 6e-4, ("gspo", 0.3): 6e-4,
             ("grpo_rr", 0.3): 6e-4}  # fmt: skip
    runs = _draw(truth, slope=6.0, seeds=60, rng=np.random.default_rng(0))
    fields = varying_fields(runs)
    assert fields == ["routing.logit_noise", "trainer.lr"]
    result = critical_lr(runs, fields, "routing.logit_noise")
    assert result["converged"] and result["runs"] == len(runs)
    for row in result["cells"]:
        arm, sigma = row["arm"].split(" ")[0], float(row["cell"].rsplit("=", 1)[1])
        star = row["lr_star"]
        assert star.lo <= math.log10(truth[(arm, sigma)]) <= star.hi, row["cell"]
    shifts = {s["arm"]: s["shift"] for s in result["shifts"]}
    assert set(shifts) == {"grpo (replay=off)", "gspo (replay=off)"}  # the replay arm has no σ = 0 cell
    assert shifts["grpo (replay=off)"].hi < 0 and shifts["grpo (replay=off)"].p < 0.05
    assert shifts["grpo (replay=off)"].lo <= math.log10(0.5) <= shifts["grpo (replay=off)"].hi
    assert shifts["gspo (replay=off)"].lo <= 0 <= shifts["gspo (replay=off)"].hi
    (inter,) = result["interactions"]
    assert inter["difference"].hi < 0 and inter["difference"].p < 0.05
    # between arms at one setting: at σ = 0.3 grpo's lr* is half gspo's and grpo_rr's, equal at σ = 0
    between = {(d["a"], d["b"]): d["ratio"] for d in result["between"]}
    assert len(between) == 4  # σ = 0: grpo-gspo; σ = 0.3: grpo-gspo, grpo-grpo_rr, gspo-grpo_rr
    half = between[("grpo (replay=off) logit_noise=0.3", "gspo (replay=off) logit_noise=0.3")]
    assert half.lo <= math.log10(0.5) <= half.hi and half.hi < 0
    same = between[("grpo (replay=off) logit_noise=0", "gspo (replay=off) logit_noise=0")]
    assert same.lo <= 0 <= same.hi
    i, j = (next(k for k, c in enumerate(result["cells"]) if c["cell"] == name) for name in
            ("grpo (replay=off) logit_noise=0.3", "gspo (replay=off) logit_noise=0.3"))  # fmt: skip
    stars = result["cells"][i]["lr_star"].log10, result["cells"][j]["lr_star"].log10
    assert half.log10 == pytest.approx(stars[0] - stars[1], abs=1e-12)  # the ratio of the two lr*
    text = format_critical(result, "routing.logit_noise")
    assert "| grpo (replay=off) | 0.3 | x0." in text and "distinguishable from noise at 5%" in text
    assert "| grpo (replay=off) logit_noise=0.3 | gspo (replay=off) logit_noise=0.3 | x0." in text


def test_regression_outcome_needs_a_pre_update_eval_and_few_lrs_give_no_section(tmp_path):
    """A run without the pre-update eval has no outcome; a sweep of two lrs has no critical-lr model; a
    report over a lr sweep adds the section, its table and its figure."""
    run = _run("grpo", "off", 1e-4, 0.0, 0, True)
    assert regressed(run) is True and regressed(Run(run.config, run.rows[1:], [], "x")) is None
    two = [_run("grpo", "off", lr, 0.0, s, lr > 1e-4) for lr in (1e-4, 2e-4) for s in range(3)]
    assert critical_lr(two, varying_fields(two), None) is None
    runs = _draw({("grpo", 0.0): 4e-4, ("gspo", 0.0): 4e-4}, slope=6.0, seeds=5, rng=np.random.default_rng(1))
    assert critical_lr(runs, varying_fields(runs), None)["shifts"] == []
    report = write_report(runs, tmp_path / "report", "lr", ["hand"], permutations=100)
    text = report.read_text()
    assert "## Critical step size" in text and "critical_lr.png" in text
    assert first_table(section(text, "Critical step size"))


def test_a_cell_that_skips_an_lr_still_gets_its_fit_and_figure(tmp_path):
    """A search grid is not always a cross product (natural_balanced's parts run some lrs only): a cell with
    no run at some lr shows 0/0 there, and the figure leaves that point out instead of failing."""
    runs = _draw({("grpo", 0.0): 4e-4, ("gspo", 0.0): 4e-4}, slope=6.0, seeds=3, rng=np.random.default_rng(2))
    runs = [r for r in runs if not (r.config["objective"]["preset"] == "gspo" and r.config["trainer"]["lr"] == LRS[0])]
    result = critical_lr(runs, varying_fields(runs), None)
    gspo = next(c for c in result["cells"] if c["arm"].startswith("gspo"))
    assert gspo["regressed_by_lr"][LRS[0]] == (0, 0)
    report = write_report(runs, tmp_path, "gap", ["hand"], permutations=100)
    assert "| 0/0 |" in section(report, "Critical step size") and (tmp_path / "critical_lr.png").is_file()
