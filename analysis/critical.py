"""Critical step size: the learning rate at which sustained regression sets in, per arm and dose.

When a sweep varies `trainer.lr` (at least MIN_LRS values) and its runs logged expected accuracy with a
pre-update eval, each run gives one binary outcome: sustained regression by its last eval
(analysis.outcomes.regression_time). A *cell* is a group less its lr: the objective arm and every
other varying field (the routing.logit_noise dose, ...). One logistic model over all runs,

    logit P(regress) = a_c + b · (log10(lr) − m),   m the mean log10 lr of the runs,

one intercept a_c per cell and one slope b shared by all (the cells may differ in where the cliff
sits, not in how steep it is), fitted by Firth's penalised maximum likelihood (`firth_logistic`). The
penalty keeps the estimates finite under complete separation: a cell that regresses at every lr above
some value and at none below, the usual case here. Covariance: the inverse Fisher information at the
estimate. Every interval is a Wald 95% interval by the delta method, every p a two-sided Wald z test:

| quantity | estimate |
|---|---|
| critical lr of cell c (P = ½) | lr*_c = 10^(m − a_c / b); flagged when it lies outside the swept lrs (an extrapolation) |
| shift of an arm's critical lr under a dose | Δ = log10 lr*_(arm, dose) − log10 lr*_(arm, 0) = −(a_(arm, dose) − a_(arm, 0)) / b, shown as the factor 10^Δ (< 1: the dose lowers the critical lr) |
| whether a dose moves two arms' critical lr alike (the arm x dose interaction) | Δ_A − Δ_B, as the factor 10^(Δ_A − Δ_B) |
| one arm's critical lr against another's at the same setting (same dose and other fields) | log10 lr*_A − log10 lr*_B = −(a_A − a_B) / b, as the factor 10^(...) |

Replay arms ignore the dose (replay wins), so they have one cell and no shift. The runs of a seed share
its warm start, which the model does not know: the runs are treated as independent, so the intervals
are, if anything, too narrow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import special
from scipy import stats as sps

from analysis.load import Run, group_label
from analysis.outcomes import regression_time
from analysis.sections import Section, Sweep, doc_intro
from analysis.stats import LEVEL, wilson

LR = "trainer.lr"
MIN_LRS = 3
"""Fewer learning rates than this cannot place a cliff: no critical-lr section."""


@dataclass(frozen=True)
class Logistic:
    """A fitted logistic model: coefficients, their covariance, and whether the fit converged."""

    beta: np.ndarray
    cov: np.ndarray
    converged: bool


def firth_logistic(X_NK: np.ndarray, y_N: np.ndarray, max_iter: int = 200, tol: float = 1e-10) -> Logistic:
    """Firth's bias-reduced logistic regression (Firth 1993, Biometrika 80:27).

    Maximises l(β) + ½ log det I(β), with l the Bernoulli log-likelihood of y given p = σ(Xβ) and
    I = Xᵀ W X, W = diag(p(1 − p)), by Newton steps on the modified score
    U*(β) = Xᵀ (y − p + h ⊙ (½ − p)), h the diagonal of W^½ X I⁻¹ Xᵀ W^½ (the hat values), halving a
    step until the penalised likelihood does not fall. Returns β, I(β)⁻¹ and convergence (the largest
    step below `tol`). For an intercept-only model the estimate is logit((k + ½) / (n + 1)).
    """
    X, y = np.asarray(X_NK, dtype=np.float64), np.asarray(y_N, dtype=np.float64)

    def info(beta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        eta = X @ beta
        p = special.expit(eta)
        return eta, p, X.T @ ((p * (1 - p))[:, None] * X)

    def penalised(beta: np.ndarray) -> float:
        eta, _, fisher = info(beta)
        return float(np.sum(y * eta - np.logaddexp(0.0, eta)) + 0.5 * np.linalg.slogdet(fisher)[1])

    beta, converged = np.zeros(X.shape[1]), False
    for _ in range(max_iter):
        _, p, fisher = info(beta)
        inv = np.linalg.inv(fisher)
        h = p * (1 - p) * np.einsum("nk,kj,nj->n", X, inv, X)
        step = inv @ (X.T @ (y - p + h * (0.5 - p)))
        base, t = penalised(beta), 1.0
        while t > 1e-8 and penalised(beta + t * step) < base - 1e-12:
            t /= 2
        beta = beta + t * step
        if np.max(np.abs(t * step)) < tol:
            converged = True
            break
    return Logistic(beta, np.linalg.inv(info(beta)[2]), converged)


@dataclass(frozen=True)
class Estimate:
    """A log10-scale estimate with its Wald interval and p (of estimate = 0)."""

    log10: float
    lo: float
    hi: float
    p: float

    def factor(self) -> str:
        """"x0.52 [0.31, 0.87], p = 0.01": the estimate and interval as factors 10^(·)."""
        return f"x{10 ** self.log10:.3g} [{10 ** self.lo:.3g}, {10 ** self.hi:.3g}], p = {self.p:.2g}"


def _wald(value: float, grad: np.ndarray, cov: np.ndarray, level: float = LEVEL) -> Estimate:
    se = float(math.sqrt(max(grad @ cov @ grad, 0.0)))
    z = sps.norm.ppf((1 + level) / 2)
    p = float(2 * sps.norm.sf(abs(value) / se)) if se > 0 else math.nan
    return Estimate(value, value - z * se, value + z * se, p)


def _cell(run: Run, fields: list[str]) -> tuple[str, tuple]:
    """(arm, the values of the other varying fields), the run's cell."""
    flat = run.flat
    return run.base_label, tuple((f, flat.get(f)) for f in fields if f != LR)


def regressed(run: Run) -> bool | None:
    """Sustained regression by the run's last eval; None without a pre-update eval."""
    t, event = regression_time(run)
    return event if math.isfinite(t) else None


def critical_lr(runs: list[Run], fields: list[str], dose_field: str | None) -> dict[str, Any] | None:
    """The module's model over `runs`: per cell its counts by lr and lr*, per arm its dose shifts, and the
    pairwise differences of those shifts; None when lr does not vary over MIN_LRS values or no run has a
    pre-update eval."""
    known = [(r, regressed(r)) for r in runs]
    known = [(r, e) for r, e in known if e is not None]
    lrs = sorted({float(r.flat[LR]) for r, _ in known}) if LR in fields else []
    if len(lrs) < MIN_LRS:
        return None
    first = {}  # cell -> its first run, which names it
    for r, _ in known:
        first.setdefault(_cell(r, fields), r)
    index = {c: i for i, c in enumerate(first)}
    X = np.zeros((len(known), len(index) + 1))
    y = np.zeros(len(known))
    for n, (r, event) in enumerate(known):
        X[n, index[_cell(r, fields)]] = 1.0
        X[n, -1] = math.log10(float(r.flat[LR]))
        y[n] = float(event)
    m = float(X[:, -1].mean())  # centred: the intercepts and the slope are then nearly uncorrelated
    X[:, -1] -= m
    fit = firth_logistic(X, y)
    b = fit.beta[-1]
    others = [f for f in fields if f != LR]

    def log_lr_star(i: int) -> Estimate:
        grad = np.zeros_like(fit.beta)
        grad[i], grad[-1] = -1 / b, fit.beta[i] / b**2
        return _wald(m - fit.beta[i] / b, grad, fit.cov)

    def shift(i: int, j: int) -> tuple[float, np.ndarray]:  # log10 lr*_i − log10 lr*_j and its gradient
        grad = np.zeros_like(fit.beta)
        grad[i], grad[j], grad[-1] = -1 / b, 1 / b, (fit.beta[i] - fit.beta[j]) / b**2
        return -(fit.beta[i] - fit.beta[j]) / b, grad

    table = []
    for cell, i in index.items():
        by_lr = {lr: [e for r, e in known if _cell(r, fields) == cell and float(r.flat[LR]) == lr] for lr in lrs}
        star = log_lr_star(i)
        table.append({
            "cell": group_label(first[cell], others), "arm": cell[0], "regressed_by_lr": {lr: (sum(v), len(v)) for lr, v in by_lr.items()},
            "lr_star": star, "extrapolated": not lrs[0] <= 10**star.log10 <= lrs[-1],
            "intercept": float(fit.beta[i] - b * m),  # on the uncentred log10 lr
        })  # fmt: skip
    shifts = []
    if dose_field is not None:
        for cell, i in index.items():
            rest = dict(cell[1])
            if float(rest.get(dose_field, 0.0)) == 0.0:
                continue
            base = (cell[0], tuple((f, 0.0 if f == dose_field else v) for f, v in cell[1]))
            if base in index:
                value, grad = shift(i, index[base])
                shifts.append({"arm": cell[0], "dose": float(rest[dose_field]), "shift": _wald(value, grad, fit.cov),
                               "grad": grad})  # fmt: skip
    interactions = []
    for a_i, a in enumerate(shifts):
        for c in shifts[a_i + 1 :]:
            if a["dose"] == c["dose"]:
                value = a["shift"].log10 - c["shift"].log10
                interactions.append({"a": a["arm"], "b": c["arm"], "dose": a["dose"],
                                     "difference": _wald(value, a["grad"] - c["grad"], fit.cov)})  # fmt: skip
    between = []  # two arms at the same setting (every other field equal)
    cells = list(index)
    for x, cell_a in enumerate(cells):
        for cell_b in cells[x + 1 :]:
            if cell_a[1] == cell_b[1] and cell_a[0] != cell_b[0]:
                value, grad = shift(index[cell_a], index[cell_b])
                between.append({"a": table[index[cell_a]]["cell"], "b": table[index[cell_b]]["cell"],
                                "ratio": _wald(value, grad, fit.cov)})  # fmt: skip
    return {"lrs": lrs, "slope": float(b), "converged": fit.converged, "runs": len(known), "cells": table,
            "shifts": [{k: v for k, v in s.items() if k != "grad"} for s in shifts],
            "interactions": interactions, "between": between}  # fmt: skip


def format_critical(result: dict[str, Any], dose_field: str | None) -> str:
    """Markdown: the regressed seeds per cell and lr with each cell's lr*, then the dose shifts and their
    differences between arms, each with a verdict in words."""
    lrs = result["lrs"]
    lines = ["| cell | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | critical lr (95% CI) |",
             "|---" * (len(lrs) + 2) + "|"]  # fmt: skip
    for row in result["cells"]:
        s = row["lr_star"]
        star = f"{10 ** s.log10:.3g} [{10 ** s.lo:.3g}, {10 ** s.hi:.3g}]" + (" (outside the grid)" if row["extrapolated"] else "")
        counts = " | ".join("{}/{}".format(*row["regressed_by_lr"][lr]) for lr in lrs)
        lines.append(f"| {row['cell']} | {counts} | {star} |")
    lines += ["", f"Cells: seeds with sustained regression / seeds at each lr. Model: Firth logistic regression of "
              f"regression on log10 lr, one intercept per cell and a common slope b = {result['slope']:.3g} "
              f"({result['runs']} runs; {'converged' if result['converged'] else 'did NOT converge'})."]
    if result["between"]:
        lines += ["", "Critical lr of one arm against another at the same setting (factor lr*_a / lr*_b, 95% CI, "
                  "Wald p):", "", "| a | b | factor | verdict |", "|---|---|---|---|"]  # fmt: skip
        for d in result["between"]:
            lines.append(f"| {d['a']} | {d['b']} | {d['ratio'].factor()} | {_verdict(d['ratio'])} |")
    if result["shifts"]:
        lines += ["", f"Shift of the critical lr under `{dose_field}` (factor lr*(dose) / lr*(0), 95% CI, Wald p):", "",
                  "| arm | dose | factor | verdict |", "|---|---|---|---|"]
        for s in result["shifts"]:
            lines.append(f"| {s['arm']} | {s['dose']:g} | {s['shift'].factor()} | {_verdict(s['shift'])} |")
    if result["interactions"]:
        lines += ["", "Does the dose move two arms' critical lr alike? (ratio of their factors, 95% CI, Wald p):", "",
                  "| arms | dose | ratio of factors | verdict |", "|---|---|---|---|"]
        for d in result["interactions"]:
            lines.append(f"| {d['a']} vs {d['b']} | {d['dose']:g} | {d['difference'].factor()} | "
                         f"{_verdict(d['difference'])} |")
    return "\n".join(lines)


def _verdict(e: Estimate) -> str:
    if not math.isfinite(e.p):
        return "no verdict possible (no spread)"
    return ("distinguishable from noise at 5%" if e.p < 0.05 else "not distinguishable from noise at 5%")


def critical_json(result: dict[str, Any]) -> dict[str, Any]:
    """The result as plain JSON values."""
    def est(e: Estimate) -> dict[str, float]:
        return {"log10": e.log10, "lo": e.lo, "hi": e.hi, "p": e.p}

    return {
        "lrs": result["lrs"], "slope": result["slope"], "converged": result["converged"], "runs": result["runs"],
        "cells": [{**{k: v for k, v in c.items() if k not in ("lr_star", "regressed_by_lr")}, "lr_star": est(c["lr_star"]),
                   "regressed_by_lr": {str(k): list(v) for k, v in c["regressed_by_lr"].items()}} for c in result["cells"]],
        "shifts": [{**{k: v for k, v in s.items() if k != "shift"}, "shift": est(s["shift"])} for s in result["shifts"]],
        "between": [{"a": d["a"], "b": d["b"], "ratio": est(d["ratio"])} for d in result["between"]],
        "interactions": [{**{k: v for k, v in d.items() if k != "difference"}, "difference": est(d["difference"])}
                         for d in result["interactions"]],
    }  # fmt: skip


CAPTION = (
    "Seeds with sustained regression (points, Wilson 95% intervals) against the learning rate, per cell, with "
    "the fitted Firth logistic curve (common slope) and each cell's critical lr (P = ½) marked."
)


def plot_critical(result: dict[str, Any], out_dir: Path) -> Path:
    """The regression rate per cell against lr (log x) with the fitted curves."""
    from analysis.plotting import finish, plt  # here: a report without this figure never imports matplotlib

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    cmap = plt.get_cmap("tab10")
    lrs = np.array(result["lrs"])
    grid = np.logspace(math.log10(lrs[0]) - 0.2, math.log10(lrs[-1]) + 0.2, 200)
    for k, row in enumerate(result["cells"]):
        color = cmap(k % 10)
        counts = [row["regressed_by_lr"][lr] for lr in result["lrs"]]
        rate = np.array([r / n if n else np.nan for r, n in counts])
        lo, hi = np.array([wilson(r, n) if n else (np.nan, np.nan) for r, n in counts]).T  # a cell may skip an lr
        jitter = 10 ** (0.015 * (k - len(result["cells"]) / 2))
        yerr = np.clip([rate - lo, hi - rate], 0, None)  # Wilson's bound at 0/n or n/n can miss by rounding
        ax.errorbar(lrs * jitter, rate, yerr=yerr, color=color, fmt="o", capsize=2, label=row["cell"])
        ax.plot(grid, special.expit(row["intercept"] + result["slope"] * np.log10(grid)), color=color, alpha=0.7)
        ax.axvline(10 ** row["lr_star"].log10, color=color, linestyle=":", linewidth=1)
    ax.set(xscale="log", xlabel="learning rate (log scale)", ylabel="seeds with sustained regression", ylim=(-0.03, 1.03))
    ax.grid(alpha=0.3)
    return finish(fig, [ax], out_dir / "critical_lr.png", "Critical step size (Firth logistic fit, common slope)")


def critical_section(sweep: Sweep) -> tuple[dict[str, Any], str | None] | None:
    """critical_lr over the sweep, with the dose field it adjusts for; None when it has nothing to fit."""
    from analysis.drift import dose_field  # here: analysis.drift imports the figures, this module does not

    field = dose_field(sweep.fields, sweep.runs)
    result = critical_lr(sweep.runs, sweep.fields, field)
    return (result, field) if result else None


SECTION = Section(
    name="critical_lr",
    heading="Critical step size",
    intro=doc_intro(__doc__),
    file="critical_lr.md",
    compute=critical_section,
    markdown=lambda r: format_critical(*r),
    json=lambda r: {"critical_lr": critical_json(r[0])},
    figures=lambda r, out_dir: {"critical_lr": (plot_critical(r[0], out_dir), CAPTION)},
)
