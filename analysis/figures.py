"""PNG figures after the GSPO paper's (analysis.plotting: Agg backend, compact palette PNGs; one color per
group, the same in every figure).

Curves are the mean over seeds; the shaded band (and the bars' error bars) is the 95% confidence
interval of that mean, Student t over the seeds at each step (BAND; analysis.stats.mean_ci). Where
only one seed has a step there is no band. Seeds are aligned on the RL step; a step missing from a
seed (stopped on collapse) is averaged over the seeds that have it. Non-finite values are left out.

Smoothing (`moe-rl-analyze --smooth W`): each seed's curve is replaced by its EMA of weight W
(analysis.stats.ema) before the mean and CI are taken, so the band is the CI of the smoothed
quantity; the unsmoothed mean is drawn faint behind it. W = 0 (the default) draws the raw curves.
The per-layer panel and the bars are not over steps and are never smoothed.

Held-out eval (eval_accuracy.png, only when some run logged `eval/accuracy`): sampled and greedy
accuracy at each eval step; steps without eval rows are skipped, not drawn as gaps.

Length within one policy (length_variance.png, only when runs logged `length/<lo>-<hi>/*` with at
least two populated bins): per group (one panel each up to analysis.plotting.MAX_GROUP_PANELS groups;
above, one panel per variance with a line per group), each response-length bin's token-ratio, within-sequence and
sequence-ratio variance over the off-policy mini-batches; per seed the mean over steps (steps where the
bin is empty left out), then the mean over seeds with its 95% CI (analysis.stats.mean_ci), log y.

Compute proxy (reward_vs_compute.png): cumulative sampled response tokens, sum over steps of
prompts_per_step * group_size * `rollout/response_len/mean`. Every response token is generated once,
scored by the old-policy forward once and trained on once per step, so training cost grows with it;
unlike wall time it does not depend on how busy the machine was. Wall time (sum of `time/step_s`)
is the second panel.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
from matplotlib.ticker import MaxNLocator

from analysis.load import Run
from analysis.plotting import MAX_GROUP_PANELS, band_plot, finish, group_colors, plt
from analysis.stats import ema, finite_mean, mean_ci

BAND = "95% CI over seeds (Student t)"
Groups = dict[str, list[Run]]
_LAYER = re.compile(r"^routing/expert_change/layer_(\d+)$")
_LENGTH = re.compile(r"^length/(\d+)-(\d+)/token_var$")
LENGTH_VARIANCES = {
    "token_var": ("token ratio r_it", "-", "o"),
    "within_seq_var": ("within sequence", "--", "s"),
    "seq_var": ("sequence ratio s_i", ":", "^"),
}
"""The `length/<bin>/<key>` variances length_variance.png draws: (legend, line style, marker)."""


def _ci_stats(v: np.ndarray) -> tuple[float, float, float]:
    """(mean, lo, hi) of the 95% t interval; lo = hi = mean with one finite value (no band)."""
    ci = mean_ci(v)
    if ci.n == 1:
        return ci.mean, ci.mean, ci.mean
    return ci.mean, ci.lo, ci.hi


def aggregate(
    runs: list[Run], values, smooth: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, CI low, CI high) over seeds of `values(run)` (an array aligned with run.rows),
    each seed's array EMA-smoothed with weight `smooth` first (0: unsmoothed)."""
    per_run = [
        dict(zip((int(r["step"]) for r in run.rows), ema(values(run), smooth), strict=True)) for run in runs
    ]
    steps = np.array(sorted(set().union(*per_run)), dtype=int)
    mean, lo, hi = (np.full(len(steps), np.nan) for _ in range(3))
    for i, step in enumerate(steps):
        v = np.array([d.get(step, np.nan) for d in per_run], dtype=float)
        if np.isfinite(v).any():
            mean[i], lo[i], hi[i] = _ci_stats(v)
    return steps, mean, lo, hi


def aggregate_columns(values_RC: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(columns, mean, CI low, CI high) over the rows (seeds) of a seeds x columns array, finite values only."""
    stats = np.full((3, values_RC.shape[1]), np.nan)
    for j, column in enumerate(values_RC.T):
        if np.isfinite(column).any():
            stats[:, j] = _ci_stats(column)
    return np.arange(values_RC.shape[1]), *stats


def cumulative_response_tokens(run: Run) -> np.ndarray:
    """The compute proxy: cumulative prompts_per_step * group_size * mean response length."""
    trainer = run.config.get("trainer", {})
    per_step = trainer.get("prompts_per_step", np.nan) * trainer.get("group_size", np.nan)
    return np.cumsum(np.nan_to_num(run.series("rollout/response_len/mean")) * per_step)


def cumulative_wall_seconds(run: Run) -> np.ndarray:
    """Cumulative `time/step_s`: wall time, which depends on the machine and its load."""
    return np.cumsum(np.nan_to_num(run.series("time/step_s")))


def _log_y(ax, values) -> str:
    """Log y axis; symlog (linear near 0) when some values are 0. Returns a note for the axis label."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    pos = v[v > 0]
    if pos.size and pos.size == v.size:
        ax.set_yscale("log")
        return ""
    thresh = 10 ** math.floor(math.log10(pos.min())) if pos.size else 1e-6
    ax.set_yscale("symlog", linthresh=thresh)
    if v.size and v.min() >= 0:  # fractions and variances: no negative decades
        ax.set_ylim(0, max(10 * thresh, 2 * float(v.max())))
    return f"\n(symlog: linear below {thresh:.0e})"


def _smoothed_band(ax, x, runs: list[Run], values, smooth: float, color, label) -> None:
    """The (smoothed) mean of `values` over seeds with its CI band against x; the raw mean faint when smoothed."""
    _, mean, lo, hi = aggregate(runs, values, smooth)
    raw = aggregate(runs, values)[1] if smooth else None
    band_plot(ax, x, mean, lo, hi, color, label, raw)


def _smooth_note(smooth: float) -> str:
    return f"; EMA {smooth:g}, raw mean faint" if smooth else ""


def plot_reward(groups: Groups, out_dir: Path, smooth: float = 0.0) -> Path:
    """Mean reward vs RL step."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, color in group_colors(groups).items():
        steps = aggregate(groups[label], lambda r: r.series("rollout/reward/mean"))[0]
        _smoothed_band(
            ax, steps, groups[label], lambda r: r.series("rollout/reward/mean"), smooth, color, label
        )
    ax.set(xlabel="RL step", ylabel="rollout/reward/mean")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    title = f"Training reward (band: {BAND}{_smooth_note(smooth)})"
    return finish(fig, [ax], out_dir / "reward_vs_step.png", title)


def plot_eval_accuracy(groups: Groups, out_dir: Path, smooth: float = 0.0) -> Path | None:
    """Held-out eval accuracy (sampled; greedy) vs RL step at the eval steps; None when no run has eval."""
    keys = ["eval/accuracy", "eval/accuracy_greedy"]
    if not any(k in r.keys() for runs in groups.values() for r in runs for k in keys):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for label, color in group_colors(groups).items():
        for ax, key in zip(axes, keys, strict=True):
            # Only eval rows: smoothing then runs over eval steps, not over the nan rows between them.
            evals = [
                Run(r.config, [row for row in r.rows if key in row], r.events, r.source)
                for r in groups[label]
            ]
            evals = [r for r in evals if r.rows]
            if evals:
                steps = aggregate(evals, lambda r, k=key: r.series(k))[0]
                _smoothed_band(ax, steps, evals, lambda r, k=key: r.series(k), smooth, color, label)
    for ax, key in zip(axes, keys, strict=True):
        ax.set(xlabel="RL step", ylabel=key, title=key)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    title = f"Held-out eval accuracy (band: {BAND}{_smooth_note(smooth)})"
    return finish(fig, axes, out_dir / "eval_accuracy.png", title)


def plot_reward_compute(groups: Groups, out_dir: Path, smooth: float = 0.0) -> Path:
    """Mean reward vs cumulative response tokens (the compute proxy) and vs cumulative wall time."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    xs = {
        "cumulative response tokens\n(prompts x group x mean response length)": cumulative_response_tokens,
        "cumulative wall time (s, sum of time/step_s)": cumulative_wall_seconds,
    }
    for ax, (xlabel, xfn) in zip(axes, xs.items(), strict=True):
        for label, color in group_colors(groups).items():
            _, x, _, _ = aggregate(groups[label], xfn)  # mean over seeds of the cumulative x at each step
            _smoothed_band(
                ax, x, groups[label], lambda r: r.series("rollout/reward/mean"), smooth, color, label
            )
        ax.set(xlabel=xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("rollout/reward/mean")
    title = f"Reward vs training compute (band: {BAND}{_smooth_note(smooth)})"
    return finish(fig, axes, out_dir / "reward_vs_compute.png", title)


def _per_run_means(groups: Groups, key: str) -> dict[str, np.ndarray]:
    return {label: np.array([finite_mean(r.series(key)) for r in runs]) for label, runs in groups.items()}


def plot_clip_fraction(groups: Groups, out_dir: Path) -> Path:
    """Bars: mean over seeds of each run's mean clip/token_frac, error bars its 95% CI (cut at 0), log y."""
    per_run = _per_run_means(groups, "clip/token_frac")
    colors = group_colors(groups)
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(groups) + 2), 4.5))
    x = np.arange(len(groups))
    stats = [_ci_stats(v) if np.isfinite(v).any() else (np.nan,) * 3 for v in per_run.values()]
    means, lo, hi = np.array(stats, dtype=float).reshape(-1, 3).T
    lo = np.maximum(lo, 0)  # a fraction: the t interval's negative part is an artefact of few seeds
    ax.bar(x, np.nan_to_num(means), color=[colors[g] for g in groups])
    ax.errorbar(x, means, yerr=[means - lo, hi - means], fmt="none", ecolor="black", capsize=4)
    for xi, m in zip(x, means, strict=True):
        ax.annotate(
            f"{m:.2g}",
            (xi, m if m > 0 else 0),
            ha="center",
            va="bottom",
            fontsize="small",
            xytext=(0, 3),
            textcoords="offset points",
        )
    note = _log_y(ax, np.concatenate([means, lo, hi]))
    ax.set_xticks(x, list(groups), rotation=25, ha="right", fontsize="small")
    ax.set_ylabel("fraction of clipped tokens\n(clip/token_frac, mean over steps)" + note)
    ax.grid(alpha=0.3, axis="y")
    return finish(fig, [ax], out_dir / "clip_fraction.png", f"Clipped-token fraction (error bars: {BAND})")


def plot_clip_vs_kl(groups: Groups, out_dir: Path) -> Path | None:
    """Per run (dot) and per group (outlined marker, the mean over seeds): mean clip/token_frac against
    mean policy/approx_kl, both over steps and mini-batches (the on-policy one included), log-log."""
    kl, clip = _per_run_means(groups, "policy/approx_kl"), _per_run_means(groups, "clip/token_frac")
    if not any(np.isfinite(v).any() for v in kl.values()):
        return None
    colors = group_colors(groups)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in groups:
        x, y = kl[label], clip[label]
        ax.scatter(x, y, color=colors[label], alpha=0.5, s=14)
        ax.scatter(finite_mean(x), finite_mean(y), color=colors[label], edgecolor="black", s=60, label=label)
    ax.set_xscale("log")
    values = np.concatenate(list(clip.values()))
    note = _log_y(ax, values)
    ax.set_xlabel("per-update KL(π_old ‖ π_θ) (policy/approx_kl, k3; mean over steps)")
    ax.set_ylabel("fraction of clipped tokens (clip/token_frac)" + note)
    ax.grid(alpha=0.3, which="both")
    return finish(fig, [ax], out_dir / "clip_vs_kl.png", "Clipped-token fraction against per-update KL")


def _layers(runs: list[Run]) -> list[int]:
    return sorted({int(m.group(1)) for r in runs for k in r.keys() if (m := _LAYER.match(k))})


def plot_expert_change(groups: Groups, out_dir: Path, smooth: float = 0.0) -> Path:
    """Expert-change fraction by step (after one update; mini-batches 2..M, over all positions and over
    response positions only, the paper's quantity) and by layer."""
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    panels = [
        ("routing/expert_change/after_one_update", "after one update (mini-batch 2)"),
        ("routing/expert_change/frac", "mean over mini-batches 2..M"),
        ("routing/expert_change/response_frac", "the same, response positions only"),
    ]
    for label, color in group_colors(groups).items():
        runs = groups[label]
        for ax, (key, _) in zip(axes, panels, strict=False):
            steps = aggregate(runs, lambda r, k=key: r.series(k))[0]
            _smoothed_band(ax, steps, runs, lambda r, k=key: r.series(k), smooth, color, label)
        layers = _layers(runs)
        if layers:
            per_seed = np.array(
                [[finite_mean(r.series(f"routing/expert_change/layer_{i}")) for i in layers] for r in runs]
            )
            _, mean, lo, hi = aggregate_columns(per_seed)
            band_plot(axes[3], np.array(layers), mean, lo, hi, color, label)
    for ax, (key, what) in zip(axes, panels, strict=False):
        ax.set(xlabel="RL step", ylabel="fraction of top-k experts changed", title=f"{key}\n{what}")
    axes[3].set(
        xlabel="layer",
        ylabel="fraction of top-k experts changed",
        title="routing/expert_change/layer_i\nmean over steps, by layer",
    )
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    layers = _layers([r for runs in groups.values() for r in runs])
    if layers:
        axes[3].set_xlim(min(layers) - 0.5, max(layers) + 0.5)
        if len(layers) <= 16:
            axes[3].set_xticks(layers)
    for ax in axes:
        ax.title.set_fontsize("medium")
        ax.grid(alpha=0.3)
    return finish(
        fig,
        axes,
        out_dir / "expert_change.png",
        f"Expert change vs the old policy (band: {BAND}{_smooth_note(smooth)})",
    )


def _binned(x: np.ndarray, y: np.ndarray, bins: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Means of x and y in up to `bins` equal-count bins of x (finite pairs only)."""
    keep = np.isfinite(x) & np.isfinite(y)
    if not keep.any():
        return np.array([]), np.array([])
    order = np.argsort(x[keep], kind="stable")
    chunks = [c for c in np.array_split(order, min(bins, order.size)) if c.size]
    return (np.array([x[keep][c].mean() for c in chunks]), np.array([y[keep][c].mean() for c in chunks]))


def plot_ratio_variance(groups: Groups, out_dir: Path) -> Path:
    """Token-ratio variance (all tokens; within sequences) vs mean response length: steps as dots, binned means as lines."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = ["ratio/token/var", "ratio/token/within_seq_var"]
    all_y: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    for label, color in group_colors(groups).items():
        x = np.concatenate([r.series("rollout/response_len/mean") for r in groups[label]])
        for ax, key in zip(axes, keys, strict=True):
            y = np.concatenate([r.series(key) for r in groups[label]])
            all_y[key].append(y)
            ax.scatter(x, y, color=color, s=8, alpha=0.3, linewidths=0)
            bx, by = _binned(x, y)
            ax.plot(bx, by, color=color, marker="o", markersize=4, label=label)
    for ax, key in zip(axes, keys, strict=True):
        note = _log_y(ax, np.concatenate(all_y[key]))
        ax.set(
            xlabel="mean response length of the step (tokens, rollout/response_len/mean)",
            ylabel=f"{key}{note}",
        )
        ax.grid(alpha=0.3)
    title = (
        "Token importance-ratio variance vs response length (dots: steps of all seeds; lines: binned means)"
    )
    return finish(fig, axes, out_dir / "ratio_variance.png", title)


def length_bins_logged(runs: list[Run]) -> list[str]:
    """The `length/<lo>-<hi>` bins some run logged, shortest first ("1-4", "5-8", ...)."""
    found = {(int(m[1]), int(m[2])) for r in runs for k in r.keys() if (m := _LENGTH.match(k))}
    return [f"{lo}-{hi}" for lo, hi in sorted(found)]


def length_variance_stats(groups: Groups) -> dict[str, dict[str, dict[str, tuple[float, float, float]]]]:
    """{group: {variance key: {bin: (mean, CI low, CI high)}}} over seeds of each run's mean over steps of
    `length/<bin>/<key>` (non-finite steps left out); plus key "seqs": the mean sequences per step."""
    bins = length_bins_logged([r for runs in groups.values() for r in runs])
    out: dict[str, dict[str, dict[str, tuple[float, float, float]]]] = {}
    for label, runs in groups.items():
        out[label] = {}
        for key in (*LENGTH_VARIANCES, "seqs"):
            per_seed = np.array([[finite_mean(r.series(f"length/{b}/{key}")) for b in bins] for r in runs])
            _, mean, lo, hi = aggregate_columns(per_seed.reshape(len(runs), len(bins)))
            out[label][key] = {b: (m, low, high) for b, m, low, high in zip(bins, mean, lo, hi, strict=True)}
    return out


def plot_length_variance(groups: Groups, out_dir: Path) -> Path | None:
    """Token-ratio, within-sequence and sequence-ratio variance by response-length bin within the same
    policy, mean over steps then over seeds with 95% CI error bars, shared log y: one panel per group up
    to MAX_GROUP_PANELS groups (ticks give each group's sequences per step); above, one panel per variance
    with a line per group, so the figure does not grow with the sweep. None unless some run logged at
    least two length bins with finite values."""
    stats = length_variance_stats(groups)
    bins = length_bins_logged([r for runs in groups.values() for r in runs])
    populated = {b for g in stats.values() for b in bins if np.isfinite(g["token_var"][b][0])}
    if len(populated) < 2:
        return None
    colors = group_colors(groups)
    series = {(label, key): np.array([stats[label][key][b] for b in bins]).reshape(-1, 3).T
              for label in groups for key in LENGTH_VARIANCES}  # fmt: skip
    # Log y over the means and upper ends; a lower end at or below 0 (a t interval over few seeds) is
    # drawn to the axis floor rather than switching the axis to symlog.
    shown = np.concatenate([np.concatenate([m, lo[lo > 0], hi]) for m, lo, hi in series.values()])
    shown = shown[np.isfinite(shown) & (shown > 0)]
    floor = shown.min() / 2 if shown.size else 1e-6
    x = np.arange(len(bins))

    def draw(ax, label, key, legend: str) -> None:
        name, style, marker = LENGTH_VARIANCES[key]
        mean, lo, hi = series[label, key]
        lo = np.maximum(lo, floor)
        # A mean at or below the floor (a variance of 0: one sequence in the bin) gets no bar below it.
        yerr = np.nan_to_num(np.clip([mean - lo, hi - mean], 0, None))
        ax.errorbar(x, mean, yerr=yerr, color=colors[label], linestyle=style, marker=marker, capsize=3, label=legend)

    per_group = len(groups) <= MAX_GROUP_PANELS
    panels = list(groups) if per_group else list(LENGTH_VARIANCES)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 1, 4.5), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, panel in zip(axes, panels, strict=True):
        if per_group:
            for key, (name, _, _) in LENGTH_VARIANCES.items():
                draw(ax, panel, key, name)
            seqs = [stats[panel]["seqs"][b][0] for b in bins]
            ticks = [f"{b}\n({n:.0f}/step)" if np.isfinite(n) else f"{b}\n(none)" for b, n in zip(bins, seqs, strict=True)]
            ax.set(title=panel, xlabel="response length (tokens, EOS included)\n(sequences per step)")
        else:
            for label in groups:
                draw(ax, label, panel, label)
            ticks = bins
            ax.set(title=LENGTH_VARIANCES[panel][0], xlabel="response length (tokens, EOS included)")
        ax.set_xticks(x, ticks, fontsize="small")
        ax.title.set_fontsize("medium")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].set_ylim(bottom=floor)
    axes[0].set_ylabel("importance-ratio variance,\noff-policy mini-batches\n(error bars at the floor reach <= 0)")
    title = f"Ratio variance by response length within one policy (error bars: {BAND})"
    return finish(fig, list(axes), out_dir / "length_variance.png", title)


FIGURES = {
    "reward_vs_step": (plot_reward, "Mean training reward per RL step."),
    "eval_accuracy": (
        plot_eval_accuracy,
        "Held-out eval accuracy at the RL temperature (left) and greedy (right), at each eval step.",
    ),
    "reward_vs_compute": (
        plot_reward_compute,
        "Reward against the compute proxy (cumulative sampled response tokens) and against wall time.",
    ),
    "clip_fraction": (
        plot_clip_fraction,
        "Fraction of clipped tokens per label (the paper's Fig. 2 comparison), log scale.",
    ),
    "clip_vs_kl": (
        plot_clip_vs_kl,
        "Clipped-token fraction against per-update KL: a dot per run, an outlined marker per group mean "
        "(how far the policy moved per update, against how much the objective discards).",
    ),
    "expert_change": (
        plot_expert_change,
        "Fraction of top-k experts that differ between the current and the old policy on the same tokens (paper §5.3).",
    ),
    "ratio_variance": (
        plot_ratio_variance,
        "Token-level importance-ratio variance against the step's mean response length: one dot per step and seed, lines join means of equal-count length bins.",
    ),
    "length_variance": (
        plot_length_variance,
        "Ratio variance by response length within one policy: per objective, each length bin's token-ratio, "
        "within-sequence and sequence-ratio variance over the off-policy mini-batches of the same steps "
        "(mean over steps, then mean over seeds with 95% CI), log scale; ticks give the sequences per step.",
    ),
}
# Curves over RL steps, which --smooth applies to; the others are per-run means or scatter plots.
SMOOTHED = {"reward_vs_step", "eval_accuracy", "reward_vs_compute", "expert_change"}


EVAL_FIGURES = frozenset({"eval_accuracy"})
"""The figures drawn from eval rows alone."""


def write_figures(groups: Groups, out_dir: Path, smooth: float = 0.0, steps: bool = True) -> dict[str, tuple[Path, str]]:
    """Every figure in FIGURES that has data (eval_accuracy needs eval rows), saved under out_dir:
    {name: (path, caption)}; `smooth` is the EMA weight of the curves in SMOOTHED; steps=False draws only
    the figures of eval rows (EVAL_FIGURES: what runs read from a per-run table can draw)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, (plot, caption) in FIGURES.items():
        if not steps and name not in EVAL_FIGURES:
            continue
        path = plot(groups, out_dir, smooth=smooth) if name in SMOOTHED else plot(groups, out_dir)
        if path is not None:
            written[name] = (path, caption)
    return written
