"""The dose-response: outcome against measured expert change when a routing perturbation is swept.

The dose is `routing.logit_noise` (σ: router-logit noise, re-routing at the margins, the faithful
instrument) or `routing.drift` (p: expert dropout), whichever the sweep varies (DOSE_FIELDS). One row
per objective arm (base label) and dose. Per run:

| quantity | per run |
|---|---|
| expert change | mean over steps of `routing/expert_change/response_frac`: the change the update forwards saw, the injected perturbation included |
| change after one update | mean over steps of `routing/expert_change/after_one_update` (mini-batch 2 against the old policy: the paper's per-update quantity; x of the phase diagram, falling back to expert change for runs without it) |
| final eval acc | `eval/accuracy` of the last row that has it |
| final greedy acc | `eval/accuracy_greedy` of the last row that has it |
| extreme weight share | mean over steps of `policy/extreme_weight_share` (the gradient weight that extreme ratios carry) |
| grad norm, updates clipped | means over steps of `train/grad_norm` (before clipping) and `train/grad_clipped_frac` (the share of updates gradient clipping scaled down) |
| collapsed | any collapse event (`collapse/events` > 0 at the last step); the kinds come from events.jsonl |
| token-ratio var, clip frac | means over steps of `ratio/token/var`, `clip/token_frac` |

Cells are mean ± 95% t-CI over seeds; the collapse rate carries its 95% Wilson interval.

Replay arms (routing.replay ≠ off) ignore the dose: replay wins, and the same seed gives bitwise-identical
runs at every dose (tests/integration/test_train_loop.py for drift, tests/unit/routing/test_router_noise.py for logit noise). Their runs at one dose therefore stand for every dose; the table
compares each perturbed arm at each dose with the replay arm of the same setting (the reference: the
same values of every other field the sweep varies, such as trainer.grad_clip): the eval-accuracy
difference, paired by seed when both cells ran the same seeds (a seed's warm start and eval set are
shared by every arm, so pairing removes the between-seed spread; `paired_t`), else Welch's; the
collapse-rate difference with its Newcombe CI and permutation p-value; a verdict in words
(analysis.stats.verdict). Where runs logged `eval/expected_accuracy` (analysis.outcomes), the table adds
each cell's expected-accuracy AUC, its paired difference to the reference, and the log-rank test of
time to sustained regression against the reference's runs (one per seed).

The dose trend: within each seed, the least-squares slope of the outcome (final eval accuracy minus
the reference's at that seed; and the expected-acc AUC, where logged) on the run's measured expert
change, per 10 percentage points of change; then a one-sample t-test over the seeds' slopes
(`slope_over_seeds`). A seed's runs share its warm start, eval set and reference, so they are not
independent: the seed, not the run, is the unit. In a sweep over several warm starts with RL seeds on each
(analysis.clusters), the unit is (warm start, seed), and each trend also gets the units' slopes judged
by a t over warm starts (each warm start's mean slope), with the ICC ("over_warm_starts"). The phase diagram plots the primary outcome (the
expected-acc AUC where logged, else final eval accuracy), its paired difference to the reference and the
collapse rate against the change after one update, the reference as a horizontal band across the
whole x range. table.json keeps every seed's values and slopes.

Difference of slopes (does the dose cost one arm more than another?): for every two perturbed arms and
outcome, the paired t over the seeds both ran of slope_a,s − slope_b,s (`trend_differences`; a seed's
two slopes share its warm start and reference, so the seed is the unit again), with Holm's adjusted p over
the pairs of arms of one outcome (analysis.stats.holm).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from analysis.clusters import CLUSTERED, cluster_contrast, detect_design, unit, unit_key
from analysis.compare import last_value
from analysis.figures import BAND
from analysis.load import Run, group_label, varying_fields
from analysis.outcomes import auc, format_regression, has_expected, regression_test
from analysis.pairs import collapsed, final_eval, outcome_difference
from analysis.plotting import finish, group_colors, plt
from analysis.sections import Section, Sweep, doc_intro
from analysis.stats import (
    format_difference,
    holm,
    mean_ci,
    paired_t,
    rate_difference,
    short_verdict,
    slope_over_seeds,
    verdict,
    wilson,
)

FIELD = "routing.drift"
DOSE_FIELDS = {"routing.logit_noise": "σ", "routing.drift": "p"}
"""The swept perturbations a dose table is drawn for, with the symbol of their dose."""
PAPER_CHANGE = 0.10
"""The GSPO paper's ~10% of activated experts changing per update (48-layer Qwen3-30B-A3B, section 5.3)."""

Groups = dict[str, list[Run]]
CAPTION = (
    "The primary outcome (left: expected-accuracy AUC where logged, else final held-out eval accuracy), its "
    "paired difference to the replay arm (middle) and the collapse rate (right) against the measured expert "
    "change after one update, one line per perturbed arm (points labelled with their dose), the replay arm "
    "as a dashed line with its band; the dotted line marks the GSPO paper's ~10%."
)


def dose_field(fields: list[str], runs: list[Run] = ()) -> str | None:
    """The perturbation this sweep varies (the first of DOSE_FIELDS among `fields`), or None; None too when
    some run perturbs the trainer's forwards (`routing.noise_scope=trainer`), where R2 is not immune and the
    replay arm is no reference (analysis.offpolicy reads such sweeps)."""
    if any(r.flat.get("routing.noise_scope") == "trainer" and r.flat.get("routing.logit_noise") for r in runs):
        return None
    return next((f for f in DOSE_FIELDS if f in fields), None)


def _kinds(runs: list[Run]) -> dict[str, int] | None:
    if any(r.events is None for r in runs):
        return None
    kinds: dict[str, int] = {}
    for run in runs:
        for kind in {e["kind"] for e in run.events}:  # seeds with the kind, not events
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _outcome_collapsed(runs: list[Run]) -> int | None:
    """Seeds with an event other than ratio_blowup (reward or entropy collapse, non-finite updates): the
    training outcome failing, not only a ratio extreme; None when a run's events are unknown (W&B)."""
    if any(r.events is None for r in runs):
        return None
    return sum(any(e["kind"] != "ratio_blowup" for e in r.events) for r in runs)


def _is_replay(runs: list[Run]) -> bool:
    return runs[0].config["routing"]["replay"] != "off"


def _arms(groups: Groups, field: str | None) -> tuple[str, dict[str, tuple[tuple, dict[float, list[Run]]]]]:
    """The dose field (`field`, or the one the groups' runs vary, else routing.drift) and: arm label ->
    (its setting, {dose: runs}). An arm is the base label plus every other field the sweep varies (grad
    clip, lr, ...), so a sweep that crosses the dose with other fields gets one dose line per arm and
    setting; its setting (those fields' values) picks the replay reference it is compared with."""
    runs = [r for g in groups.values() for r in g]
    fields = varying_fields(runs)
    field = field or dose_field(fields) or FIELD
    other = [f for f in fields if f != field]
    arms: dict[str, tuple[tuple, dict[float, list[Run]]]] = {}
    for g in groups.values():
        label = group_label(g[0], other)
        setting = tuple(repr(g[0].flat.get(f)) for f in other)
        arms.setdefault(label, (setting, {}))[1].setdefault(float(g[0].flat[field]), []).extend(g)
    return field, arms


def _references(arms: dict[str, tuple[tuple, dict[float, list[Run]]]]) -> dict[tuple, str]:
    """Setting -> the first replay arm with that setting."""
    refs: dict[tuple, str] = {}
    for arm, (setting, cells) in arms.items():
        if _is_replay(next(iter(cells.values()))):
            refs.setdefault(setting, arm)
    return refs


def dose_table(groups: Groups, permutations: int = 10_000, field: str | None = None) -> list[dict[str, Any]]:
    """One dict per (arm, dose of `field`), arms in group order, doses ascending: seeds, the module's
    quantities (mean, CI half, n), collapsed seeds with their Wilson interval and kinds, and
    `vs_reference` (None for a replay arm itself, or when no replay arm ran with the arm's setting)."""
    field, arms = _arms(groups, field)
    refs = _references(arms)
    out = []
    for arm, (setting, cells) in arms.items():
        reference = refs.get(setting)
        ref_runs = [r for cell in arms[reference][1].values() for r in cell] if reference else []
        for p in sorted(cells):
            runs = cells[p]
            rows = [r.summary() for r in runs]
            k, n = sum(collapsed(r) for r in runs), len(runs)
            per_seed = {
                "seed": [r.seed for r in runs], "expert change": [x["expert change"] for x in rows],
                "change after one update": [_after_one(r) for r in runs],
                "final eval acc": [final_eval(r) for r in runs],
                "final greedy acc": [last_value(r.rows, "eval/accuracy_greedy") for r in runs],
                "extreme weight share": [_mean_of(r, "policy/extreme_weight_share") for r in runs],
                "grad norm": [_mean_of(r, "train/grad_norm") for r in runs],
                "updates clipped": [_mean_of(r, "train/grad_clipped_frac") for r in runs],
                "token-ratio var": [x["token-ratio var"] for x in rows],
                "clip frac": [x["clip frac"] for x in rows], "expected-acc AUC": [auc(r) for r in runs],
                "collapsed": [collapsed(r) for r in runs],
            }  # fmt: skip
            row = {
                "arm": arm, "field": field, "dose": p, "seeds": per_seed["seed"], "replay": _is_replay(runs),
                **{q: mean_ci(per_seed[q]) for q in QUANTITIES},
                "collapsed": k, "collapse wilson": wilson(k, n), "kinds": _kinds(runs),
                "outcome collapsed": _outcome_collapsed(runs),
                "reference": reference, "vs_reference": None, "per_seed": per_seed,
            }  # fmt: skip
            if reference is not None and not row["replay"]:
                row["vs_reference"] = _versus(runs, ref_runs, permutations)
            out.append(row)
    return out


QUANTITIES = ("expert change", "change after one update", "final eval acc", "final greedy acc", "token-ratio var",
              "clip frac", "extreme weight share", "grad norm", "updates clipped", "expected-acc AUC")


def _mean_of(run: Run, key: str) -> float:
    """Mean over the run's rows of a per-step metric (its finite values); nan when none has it."""
    return run.mean(key)


def _after_one(run: Run) -> float:
    """Mean `routing/expert_change/after_one_update`, or the run's mean expert change without it."""
    value = _mean_of(run, "routing/expert_change/after_one_update")
    return value if math.isfinite(value) else run.summary()["expert change"]


def _one_per_seed(runs: list[Run]) -> list[Run]:
    """The first run of each unit (warm start, seed): the reference's runs at every p are the same run
    (replay wins)."""
    first: dict[tuple, Run] = {}
    for run in runs:
        first.setdefault(unit(run), run)
    return list(first.values())


def dose_trend(groups: Groups, field: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Per perturbed arm and outcome ("final eval acc", and "expected-acc AUC" where logged): the mean over
    seeds of each seed's slope of (outcome - the reference's, same seed) on the measured change after one
    update, per 10 percentage points, with a one-sample t-test over those slopes: {"slope": Difference (n = seeds),
    "per_seed": {seed: slope}}. Only seeds the reference ran count. Subtracting the reference shifts a
    seed's points without changing its slope; it keeps the y axis that of the dose table's differences."""
    field, arms = _arms(groups, field)
    refs = _references(arms)
    clustered = detect_design([r for rs in groups.values() for r in rs]).kind == CLUSTERED
    out = {}
    for arm, (setting, cells) in arms.items():
        runs = [r for cell in cells.values() for r in cell]
        if _is_replay(runs) or setting not in refs:
            continue
        ref_runs = _one_per_seed([r for cell in arms[refs[setting]][1].values() for r in cell])
        outcomes = {"final eval acc": final_eval, **({"expected-acc AUC": auc} if has_expected(ref_runs) else {})}
        out[arm] = {}
        for name, outcome in outcomes.items():
            ref = {unit_key(r, clustered): outcome(r) for r in ref_runs}
            x: dict[Any, list[float]] = {}
            y: dict[Any, list[float]] = {}
            for r in runs:
                k = unit_key(r, clustered)
                if k in ref:
                    x.setdefault(k, []).append(_after_one(r) / 0.1)
                    y.setdefault(k, []).append(outcome(r) - ref[k])
            slope, per_seed = slope_over_seeds(x, y)
            out[arm][name] = {"slope": slope, "per_seed": per_seed}
            if clustered:  # the units' slopes judged over warm starts, not as independent units
                warm = {repr(unit(r)): repr(unit(r)[0]) for r in runs}
                by_w: dict[str, dict[Any, float]] = {}
                for k, v in per_seed.items():
                    by_w.setdefault(warm[k], {})[k] = v
                c = cluster_contrast(by_w, {w: dict.fromkeys(us, 0.0) for w, us in by_w.items()})
                out[arm][name]["over_warm_starts"] = dataclasses.asdict(c)
    return out


def format_trend(trend: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: one line per drifting arm and outcome."""
    lines = ["| arm | outcome | seeds | Δ per +10 points of expert change: mean of per-seed slopes (95% CI) | p "
             "| verdict |", "|---" * 6 + "|"]
    for arm, by_outcome in trend.items():
        for name, t in by_outcome.items():
            d = t["slope"]
            ci = f"[{d.lo:+.3f}, {d.hi:+.3f}]" if math.isfinite(d.lo) else ""
            lines.append(f"| {arm} | {name} | {d.n_a} | {d.diff:+.3f} {ci} | {d.p:.2g} | {short_verdict(verdict(d))} |")
            w = t.get("over_warm_starts")
            if w is not None:
                wci = f"[{w['lo']:+.3f}, {w['hi']:+.3f}]" if math.isfinite(w["lo"]) else ""
                lines.append(f"| {arm} | {name}, over {w['warm_starts']} warm starts (ICC {w['icc']:.2f}) "
                             f"| {w['warm_starts']} | {w['diff']:+.3f} {wci} | {w['p']:.2g} | t over warm starts |")
    return "\n".join(lines)


def trend_json(trend: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The dose trend as plain JSON values (seeds as string keys)."""
    return {arm: {name: {"slope": dataclasses.asdict(t["slope"]), "per_seed": {str(k): v for k, v in t["per_seed"].items()},
                         **({"over_warm_starts": t["over_warm_starts"]} if "over_warm_starts" in t else {})}
                  for name, t in by_outcome.items()} for arm, by_outcome in trend.items()}  # fmt: skip


def trend_differences(trend: dict[str, Any]) -> list[dict[str, Any]]:
    """From `trend_json`'s form (also a committed table.json's "dose_trend"): for every two arms (in order)
    and every outcome both have, the paired t over shared seeds of their per-seed slopes, a - b:
    [{"a", "b", "outcome", "diff", "lo", "hi", "p", "n_a", "n_b", "test", "verdict"}]."""
    rows = []
    arms = list(trend)
    for i, a in enumerate(arms):
        for b in arms[i + 1:]:
            for name in (n for n in trend[a] if n in trend[b]):
                sa, sb = trend[a][name]["per_seed"], trend[b][name]["per_seed"]
                seeds = sorted(set(sa) & set(sb), key=lambda s: (len(str(s)), str(s)))
                d = paired_t([sa[s] for s in seeds], [sb[s] for s in seeds])
                d = dataclasses.replace(d, test="paired t-test over per-seed slopes")
                rows.append({"a": a, "b": b, "outcome": name, **dataclasses.asdict(d), "verdict": verdict(d)})
    for name in {r["outcome"] for r in rows}:  # Holm within each outcome's family of arm pairs
        family = [r for r in rows if r["outcome"] == name]
        for r, adj in zip(family, holm([r["p"] for r in family]), strict=True):
            r["p_holm"] = adj
    return rows


def format_trend_differences(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per pair of arms and outcome."""
    lines = ["| a | b | outcome | seeds | slope a − slope b, per +10 points (95% CI) | p | p, Holm over the outcome's "
             "rows | verdict (uncorrected) |", "|---" * 8 + "|"]
    for r in rows:
        ci = f"[{r['lo']:+.4f}, {r['hi']:+.4f}]" if math.isfinite(r["lo"]) else ""
        lines.append(f"| {r['a']} | {r['b']} | {r['outcome']} | {r['n_a']} | {r['diff']:+.4f} {ci} | {r['p']:.2g} "
                     f"| {r['p_holm']:.2g} | {short_verdict(r['verdict'])} |")
    return "\n".join(lines)


def _versus(a: list[Run], b: list[Run], permutations: int) -> dict[str, Any]:
    acc = outcome_difference(a, b)
    rate = rate_difference([collapsed(r) for r in a], [collapsed(r) for r in b], permutations)
    out = {"acc": acc, "acc verdict": short_verdict(verdict(acc)), "rate": rate, "rate verdict": short_verdict(verdict(rate)),
           "auc": None, "auc verdict": None, "regression": None}  # fmt: skip
    if has_expected(a + b):
        one = _one_per_seed(b)
        out["auc"] = outcome_difference(a, one, auc)
        out["auc verdict"] = short_verdict(verdict(out["auc"]))
        out["regression"] = regression_test(a, one)
    return out


def plain(v: Any) -> Any:
    """A table value as plain JSON: dataclasses (MeanCI, Difference) as dicts, dicts recursively."""
    if dataclasses.is_dataclass(v):
        return dataclasses.asdict(v)
    return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v


def dose_json(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table as plain JSON values (each mean with its CI half-width and n, each difference whole)."""
    return [plain(row) for row in table]


def _dose_name(table: list[dict[str, Any]]) -> str:
    """The dose column's header: "logit noise σ" or "drift p"."""
    field = table[0]["field"] if table else FIELD
    return f"{field.split('.', 1)[1].replace('_', ' ')} {DOSE_FIELDS.get(field, '')}".strip()


def format_dose(table: list[dict[str, Any]]) -> str:
    """Markdown: one line per (arm, dose), then the comparison with the replay reference (the primary
    outcome, the expected-acc AUC, first where logged)."""
    references = list(dict.fromkeys(r["reference"] for r in table if r["reference"]))
    reference = ", ".join(f"**{a}**" for a in references) or None
    dose = _dose_name(table)
    expected = any(r["expected-acc AUC"].n for r in table)
    lines = [
        f"| arm | {dose} | seeds | change after one update | expert change (update forwards) "
        + ("| expected-acc AUC " if expected else "")
        + "| final eval acc | final greedy acc | collapsed seeds (Wilson 95%) | kinds (seeds) | token-ratio var "
        "| clip frac | extreme weight share | grad norm | updates clipped |",
        "|---" * (15 if expected else 14) + "|",
    ]
    for r in table:
        lo, hi = r["collapse wilson"]
        kinds = "unknown" if r["kinds"] is None else ", ".join(f"{k}: {v}" for k, v in sorted(r["kinds"].items()))
        lines.append(
            f"| {r['arm']} | {r['dose']:g}" + (" (any: replay wins)" if r["replay"] else "")
            + f" | {len(r['seeds'])} | {_pct(r['change after one update'])} | {_pct(r['expert change'])} "
            + (f"| {r['expected-acc AUC'].format(3)} " if expected else "")
            + f"| {r['final eval acc'].format()} | {r['final greedy acc'].format()} "
            f"| {r['collapsed']}/{len(r['seeds'])} [{lo:.2f}, {hi:.2f}] | {kinds or '–'} "
            f"| {r['token-ratio var'].format(3)} | {r['clip frac'].format(3)} | {r['extreme weight share'].format(3)} "
            f"| {r['grad norm'].format(3)} | {r['updates clipped'].format(2)} |"
        )
    if reference is None:
        return "\n".join(lines)
    lines += [
        "",
        f"Against the replay reference with the same setting ({reference}; its runs stand for every dose): differences (95% CI and "
        "p of a paired t-test over seeds, or Welch's when the seeds differ) in the expected-acc AUC (where "
        "logged: the primary outcome) and in final eval accuracy; the log-rank test of time to sustained "
        "regression (below 0.8 x the pre-update expected accuracy at two evals in a row); the collapse-rate "
        "difference (Newcombe 95% CI, permutation p).",
        "",
        f"| arm | {dose} | " + ("Δ expected-acc AUC | verdict | time to regression | " if expected else "")
        + "Δ eval acc | verdict | Δ collapse rate | verdict |",
        "|---" * (9 if expected else 6) + "|",
    ]
    for r in table:
        v = r["vs_reference"]
        if v is None:
            continue
        auc_cells = ""
        if expected:
            auc_cells = ("n/a | | | " if v["auc"] is None else
                         f"{format_difference(v['auc'])} | {v['auc verdict']} | {format_regression(v['regression'])} | ")
        lines.append(
            f"| {r['arm']} | {r['dose']:g} | {auc_cells}{format_difference(v['acc'])} | {v['acc verdict']} "
            f"| {format_difference(v['rate'])} | {v['rate verdict']} |"
        )
    return "\n".join(lines)


def _pct(ci) -> str:
    if ci.n == 0:
        return "n/a"
    half = f" ± {100 * ci.half:.2g}%" if math.isfinite(ci.half) else ""
    return f"{100 * ci.mean:.3g}%{half}"


def plot_phase_diagram(groups: Groups, table: list[dict[str, Any]], out_dir: Path) -> Path:
    """Against the measured change after one update (log x): the primary outcome (expected-acc AUC where
    logged, else final eval accuracy), its paired difference to the replay reference, and the collapse
    rate (any event; dotted: reward, entropy or non-finite events only), one line per perturbed arm with
    its band; the reference as a horizontal band; the paper's ~10%."""
    expected = any(r["expected-acc AUC"].n for r in table)
    outcome, diff_key = ("expected-acc AUC", "auc") if expected else ("final eval acc", "acc")
    x_key = "change after one update"
    colors = group_colors({r["arm"]: None for r in table})
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    xs = [r[x_key].mean for r in table if math.isfinite(r[x_key].mean) and r[x_key].mean > 0]
    x_lo, x_hi = min([0.005, *xs]) / 1.3, max([0.2, *xs]) * 1.3
    for arm in dict.fromkeys(r["arm"] for r in table):
        rows = [r for r in table if r["arm"] == arm]
        acc = _band(rows, lambda r: (r[outcome].mean, r[outcome].lo, r[outcome].hi))
        rate = _band(rows, lambda r: (r["collapsed"] / len(r["seeds"]), *r["collapse wilson"]))
        color = colors[arm]
        if rows[0]["replay"]:
            label = f"{arm}: any dose (replay wins)"
            for ax, (m, lo, hi) in zip(axes, (acc[0], (0.0, 0.0, 0.0), rate[0]), strict=True):
                ax.axhline(m, color=color, linestyle="--", label=label)
                ax.axhspan(lo, hi, color=color, alpha=0.12, linewidth=0)
            continue
        x = np.array([r[x_key].mean for r in rows])

        def versus(r: dict[str, Any]) -> tuple[float, float, float]:
            d = (r["vs_reference"] or {}).get(diff_key)
            return (d.diff, d.lo, d.hi) if d is not None else (math.nan,) * 3

        diff = _band(rows, versus)
        for ax, y in zip(axes, (acc, diff, rate), strict=True):
            ax.plot(x, y[:, 0], color=color, marker="o", label=arm)
            ax.fill_between(x, y[:, 1], y[:, 2], color=color, alpha=0.2, linewidth=0)
        kinds = [r["outcome collapsed"] for r in rows]
        if all(k is not None for k in kinds):
            axes[2].plot(x, [k / len(r["seeds"]) for k, r in zip(kinds, rows, strict=True)], color=color,
                         linestyle=":", marker="x", label=f"{arm}: reward, entropy or non-finite events only")
    name = "expected-accuracy AUC (mean over training)" if expected else "final held-out eval accuracy"
    ylabels = (name, f"Δ {name.split(' (')[0]} vs the replay arm\n(same seed; paired 95% CI)",
               "collapse rate (seeds with an event)")
    for ax, ylabel in zip(axes, ylabels, strict=True):
        ax.set_xscale("log")
        ax.set_xlim(x_lo, x_hi)
        ax.axvline(PAPER_CHANGE, color="grey", linestyle=":", label="GSPO paper: ~10% per update")
        ax.set_xlabel("measured expert change after one update (log scale)")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{100 * v:g}%"))
    axes[1].axhline(0.0, color="black", linewidth=0.8)
    axes[2].set_ylim(-0.02, 1.02)
    symbol = DOSE_FIELDS.get(table[0]["field"], "dose") if table else "dose"
    doses: dict[float, list[float]] = {}
    for r in table:
        if not r["replay"] and math.isfinite(r[x_key].mean):
            doses.setdefault(r["dose"], []).append(r[x_key].mean)
    for p, x in doses.items():  # each injected dose at the mean change its arms measured
        axes[0].annotate(f"{symbol}={p:g}", (float(np.mean(x)), 1), xytext=(0, -10), textcoords="offset points",
                         xycoords=("data", "axes fraction"), fontsize="x-small", color="grey", ha="center")
    return finish(fig, axes, out_dir / "phase_diagram.png",
                   f"Dose-response, {_dose_name(table)} (bands: outcome {BAND}; collapse rate Wilson 95%)")


def _band(rows: list[dict[str, Any]], stats) -> np.ndarray:
    """[cells, 3] (value, low, high); a cell without an interval (one seed) gets a zero-width band."""
    out = np.array([stats(r) for r in rows], dtype=float)
    missing = ~np.isfinite(out[:, 1])
    out[missing, 1:] = out[missing, :1]
    return out


@dataclasses.dataclass(frozen=True)
class Dose:
    """The dose section's result: the table, the dose trend and the difference of slopes, with the groups
    the phase diagram draws."""

    groups: Groups
    table: list[dict[str, Any]]
    trend: dict[str, dict[str, dict[str, Any]]]
    slopes: list[dict[str, Any]]


def dose(sweep: Sweep) -> Dose:
    """The dose table (against the replay arm), its trend over doses and the trends' paired differences."""
    field = dose_field(sweep.fields, sweep.runs)
    trend = dose_trend(sweep.groups, field)
    return Dose(sweep.groups, dose_table(sweep.groups, sweep.permutations, field), trend,
                trend_differences(trend_json(trend)))  # fmt: skip


def format_dose_section(d: Dose) -> str:
    """dose_table.md: the dose table, the dose trend and (where there are two arms) the slopes' differences."""
    return (format_dose(d.table) + "\n\nDose trend:\n\n" + format_trend(d.trend)
            + ("\n\nDifference of slopes (paired by seed):\n\n" + format_trend_differences(d.slopes)
               if d.slopes else ""))  # fmt: skip


SECTION = Section(
    name="dose",
    heading="Dose-response",
    intro=doc_intro(__doc__),
    file="dose_table.md",
    applies=lambda sweep: dose_field(sweep.fields, sweep.runs) is not None,
    compute=dose,
    markdown=format_dose_section,
    body=lambda d: format_dose_section(d) if d.table else "",
    json=lambda d: {"dose": dose_json(d.table), "dose_trend": trend_json(d.trend), "dose_trend_differences": d.slopes},
    figures=lambda d, out_dir: {"phase_diagram": (plot_phase_diagram(d.groups, d.table, out_dir), CAPTION)},
    lead=True,
)


def main(argv: list[str] | None = None) -> None:
    """`python -m analysis.drift TABLE.json`: the difference-of-slopes table of a committed report's dose trend."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m analysis.drift path/to/table.json")
    print(format_trend_differences(trend_differences(json.loads(Path(args[0]).read_text())["dose_trend"])))


if __name__ == "__main__":
    main()
