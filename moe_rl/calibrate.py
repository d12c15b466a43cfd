"""Calibrate the volatility instruments against natural re-routing on one policy: `moe-rl-calibrate`.

    moe-rl-calibrate task=arithmetic model=tiny --out results/calibration
    moe-rl-calibrate model=fine model.router_aux_loss_coef=0.01 --lrs 1e-4,3e-4 --out results/cal_fine
    moe-rl-calibrate --summarize results/calibration results/cal_fine --out results/cal_summary

It takes the run's warm-started policy (the same Hydra config as `moe-rl-train`, warm start cached), runs
`--rl-steps` real RL steps (5) so that AdamW has state (its first step from fresh state moves every weight
by about lr: step 0's natural change is several times a later step's), then samples `--batches` rollout
batches as RL would, and splits each batch's rows in two halves:
- **measure rows** B: the old policy's clean forward gives the reference routing, log-probs and router
  margins; each injection is then one forward over B, compared with it (no update);
- **update rows** A: for the natural effect, one real optimizer step of the configured objective on A at
  each `--lrs` value (state restored after each), then a clean forward over B: the paper's "after one
  update" on rows the update did not see, exactly as mini-batch 2 of an RL step. Its |Δ log π| is the
  re-routing's own: the updated policy routed freely against the updated policy replaying the old
  routing (so the update's direct effect on every weight cancels, and every row compares like with like).

Injections (moe_rl.trainer.plan): `drift` p (expert dropout), `logit_noise` σ (the top-k of z + σε),
`logit_noise_staleness` σ (the mean over mini-batches j = 2..M of the change at σ·sqrt(j-1), what
`routing.noise_growth=sqrt` gives over a step), `weight_noise` σ_w (router weights + N(0, σ_w²)).

Measured for each, over B's response tokens (`calibration.json`, `calibration.md`, `calibration.png`):
expert change (1 - |A∩B|/K, mean over tokens and layers), mean and p99 of |Δ log π| against the clean
forward, and for logit noise the change the margins predict (`routing.predicted_change`). Also the
policy's router statistics: margins (median, p10, fraction below 0.1), load CV and dead experts.

What replay removes (issue 57). Every |Δ log π| above is routing-only: an injection's against the clean
forward at the same weights, and a natural update's free routing against the same updated weights
replaying the old routing, i.e. |log π(θ', routing(θ')) − log π(θ', routing(θ))|, the damage routing
replay removes. Beside it the natural rows give the whole update's damage, |log π(θ', routing(θ')) −
log π(θ, routing(θ))| (`whole_dlogp_mean`), and every row the damage per changed expert: mean |Δ log π|
over the changed experts per token, change x K x L (`dlogp_per_changed_expert`). With `--staleness
1,2,4,...` one trajectory of real RL steps from the calibrated policy gives the same three after k updates
(`stale` rows, scale k): B's routing and log-probs at the start are the stale sampler's, the policy k
steps later is the proximal one, exactly what R3 replays under rollout.staleness=k. The dose check
(`summary_table`) compares noise and natural damage per changed expert at the training lr
(trainer.lr), not at the lr whose change is nearest: a 30x lr moves the weights, not just the routing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from tqdm import tqdm

from moe_rl.objectives import group_advantages
from moe_rl.rollout import response_logprobs
from moe_rl.routing import (
    RoutingTrace,
    expert_change_fraction,
    expert_load,
    margin_summary,
    predicted_change,
    router_margins,
)
from moe_rl.trainer.batch import Batch
from moe_rl.trainer.plan import RoutingPlan, perturbs, step_noise
from moe_rl.trainer.reduce import response_positions
from moe_rl.trainer.run import build_context
from moe_rl.trainer.step import StepContext, old_policy, rl_step, update

KINDS = ("drift", "logit_noise", "logit_noise_staleness", "weight_noise")
DEFAULTS = {
    "drift": [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4],
    "logit_noise": [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6],
    "weight_noise": [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05],
}


def _forward(ctx: StepContext, batch: Batch, sl: slice, perturb=None) -> tuple[torch.Tensor, RoutingTrace]:
    """Log-probs and routing of rows `sl` under `perturb` (a context manager factory, or None)."""
    R = batch.response_mask_BR.shape[1]
    with torch.no_grad(), ctx.controller.record(with_logits=True) as rec:
        with perturb() if perturb is not None else contextlib.nullcontext():
            logp = response_logprobs(ctx.model, batch.input_ids_BS[sl], batch.attention_mask_BS[sl], R,
                                     ctx.cfg.sampler.temperature or 1.0)
    return logp, rec.trace


class _Measure:
    """Pooled comparisons with the clean forward of the measure rows, over batches."""

    def __init__(self) -> None:
        self.change: dict[tuple[str, float], list[float]] = {}
        self.dlogp: dict[tuple[str, float], list[torch.Tensor]] = {}
        self.whole: dict[tuple[str, float], list[torch.Tensor]] = {}

    def add(self, key: tuple[str, float], change: float, dlogp: torch.Tensor, whole: torch.Tensor | None = None) -> None:
        self.change.setdefault(key, []).append(change)
        self.dlogp.setdefault(key, []).append(dlogp)
        if whole is not None:
            self.whole.setdefault(key, []).append(whole)

    def rows(self, slots: int) -> list[dict]:
        """One row per (kind, scale); `slots` = K x L, the expert slots of a token over the layers."""
        out = []
        for (kind, scale), changes in self.change.items():
            d = torch.cat(self.dlogp[(kind, scale)]).double()
            change = sum(changes) / len(changes)
            row = {"kind": kind, "scale": scale, "expert_change": change,
                   "dlogp_mean": float(d.mean()), "dlogp_p99": float(torch.quantile(d, 0.99)),
                   "tokens": int(d.numel()),
                   "dlogp_per_changed_expert": float(d.mean()) / (change * slots) if change > 0 else None}
            if (kind, scale) in self.whole:
                row["whole_dlogp_mean"] = float(torch.cat(self.whole[(kind, scale)]).double().mean())
            out.append(row)
        return out


def _weight_noise(ctx: StepContext, sigma: float, seed: int):
    """A context manager factory adding N(0, σ²) to every router weight, restored on exit."""

    @contextlib.contextmanager
    def cm():
        g = torch.Generator().manual_seed(seed)
        saved = [r.weight.detach().clone() for r in ctx.controller.routers]
        with torch.no_grad():
            for r in ctx.controller.routers:
                r.weight.add_((torch.randn(r.weight.shape, generator=g) * sigma).to(r.weight))
        try:
            yield
        finally:
            with torch.no_grad():
                for r, w in zip(ctx.controller.routers, saved, strict=True):
                    r.weight.copy_(w)

    return cm


def _noise(ctx: StepContext, batch: Batch, sl: slice, step: int, scale: float):
    return lambda: ctx.controller.noise(step_noise(ctx.controller, ctx.cfg.seed, step, batch, sl, scale))


def _compare(meas: _Measure, key, ref, got, resp_bS1, mask_bR, before: torch.Tensor | None = None) -> None:
    """`got` against `ref` (log-probs and traces); `before`: the log-probs before an update, for its whole damage."""
    (logp0, trace0), (logp1, trace1) = ref, got
    whole = None if before is None else (logp1 - before)[mask_bR].abs()
    meas.add(key, expert_change_fraction(trace1, trace0, resp_bS1), (logp1 - logp0)[mask_bR].abs(), whole)


def _replay_removable(ctx: StepContext, batch: Batch, B: slice, ref, key, meas: _Measure) -> None:
    """At the current weights θ', the free forward of rows B against the same weights replaying `ref`'s
    routing (recorded at θ): |log π(θ', routing(θ')) − log π(θ', routing(θ))|, and the whole damage
    against `ref`'s log-probs."""
    logp_free, trace_free = _forward(ctx, batch, B)
    logp_replay, _ = _forward(ctx, batch, B, lambda: ctx.controller.replay(ref[1]))
    _compare(meas, key, (logp_replay, ref[1]), (logp_free, trace_free), response_positions(batch, B),
             batch.response_mask_BR[B], before=ref[0])


def _restorer(ctx: StepContext) -> Callable[[], None]:
    """A function that puts the model, optimizer and scheduler back to their state now (callable repeatedly)."""
    model_state = copy.deepcopy(ctx.model.state_dict())
    opt_state = copy.deepcopy(ctx.optimizer.state_dict())
    sched_state = ctx.scheduler.state_dict()

    def restore() -> None:
        ctx.model.load_state_dict(model_state)
        ctx.optimizer.load_state_dict(opt_state)
        ctx.scheduler.load_state_dict(sched_state)

    return restore


def _natural(ctx: StepContext, batch: Batch, A: slice, B: slice, step: int, lrs: list[float], ref, meas) -> None:
    """One real update on rows A at each lr, then the clean forward of rows B against the reference."""
    restore = _restorer(ctx)
    batch.minibatches = [A]
    plan = RoutingPlan(ctx.cfg.routing, ctx.controller, batch, step, ctx.cfg.seed)  # unperturbed (main)
    old = old_policy(ctx.forwards, batch, plan)
    for lr in lrs:
        for group in ctx.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # the router group keeps trainer.router_lr_scale
        update(ctx.forwards, ctx.stepper, ctx.objective, batch, old, plan, 0)
        # The re-routing's own effect: the updated policy routed freely against the same policy replaying
        # the old routing (R2), so the update's direct effect on every weight cancels; its whole effect beside it.
        _replay_removable(ctx, batch, B, ref, ("natural", lr), meas)
        restore()


def _staleness(ctx: StepContext, batch: Batch, B: slice, first_step: int, ks: list[int], meas: _Measure) -> None:
    """One trajectory of max(ks) real RL steps from the current policy; after k of them, the replay-removable
    and whole damage and the expert change on rows B against their routing and log-probs at the start (the
    stale sampler's). The model, optimizer and scheduler are restored afterwards."""
    restore = _restorer(ctx)
    ref = _forward(ctx, batch, B)
    for k in range(1, max(ks) + 1):
        rl_step(ctx, first_step + k - 1)
        if k in ks:
            _replay_removable(ctx, batch, B, ref, ("stale", float(k)), meas)
    restore()


def calibrate(
    ctx: StepContext, batches: int, lrs: list[float], scales: dict[str, list[float]], rl_steps: int = 0,
    staleness: list[int] = (),
) -> dict:
    """The calibration of `ctx`'s policy (module docstring) after `rl_steps` real RL steps (so AdamW has
    state: its first step from fresh state moves every weight by about lr, far more than a later one), with
    a staleness trajectory of max(`staleness`) more RL steps; returns what calibration.json holds."""
    meas, margins, loads = _Measure(), [], []
    M, K = ctx.cfg.trainer.mini_batches, ctx.controller.top_k
    todo = rl_steps + batches * (sum(len(v) for v in scales.values()) + len(scales["logit_noise"]) + len(lrs))
    todo += max(staleness, default=0)
    stale_batch = None
    bar = tqdm(total=todo, desc="calibrate", disable=not ctx.cfg.logger.progress)
    for step in range(rl_steps):
        rl_step(ctx, step)
        bar.update()
    for step in range(rl_steps, rl_steps + batches):
        roll, scores = ctx.sampler.rollout(ctx.task, step, ctx.shard)
        rewards_B = scores.rewards_B
        adv_B = group_advantages(rewards_B, ctx.cfg.trainer.group_size, normalize_std=ctx.cfg.objective.normalize_std)
        n = len(rewards_B)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(step))
        batch = Batch.from_rollout(roll, adv_B, perm)
        A, B = slice(0, n // 2), slice(n // 2, n)
        resp, mask = response_positions(batch, B), batch.response_mask_BR[B]
        ref = _forward(ctx, batch, B)
        logits = ref[1].router_logits_BTLE[resp]
        if ctx.controller.num_experts > K:
            margins.append(router_margins(logits, K).flatten())
        loads.append(expert_load(ref[1], batch.valid_BS1[B]))
        for p in scales["drift"]:
            g = torch.Generator().manual_seed(step * 1009 + 1)
            _compare(meas, ("drift", p), ref, _forward(ctx, batch, B, lambda p=p, g=g: ctx.controller.drift(p, g)),
                     resp, mask)
            bar.update()
        for s in scales["logit_noise"]:
            _compare(meas, ("logit_noise", s), ref, _forward(ctx, batch, B, _noise(ctx, batch, B, step, s)), resp, mask)
            bar.update()
            for j in range(1, M):  # mini-batches 2..M, pooled
                scale = s * math.sqrt(j)
                _compare(meas, ("logit_noise_staleness", s), ref,
                         _forward(ctx, batch, B, _noise(ctx, batch, B, step, scale)), resp, mask)
            bar.update()
        for s in scales["weight_noise"]:
            _compare(meas, ("weight_noise", s), ref, _forward(ctx, batch, B, _weight_noise(ctx, s, step)), resp, mask)
            bar.update()
        _natural(ctx, batch, A, B, step, lrs, ref, meas)
        bar.update(len(lrs))
        stale_batch = stale_batch or (batch, B)
    if staleness:  # after the per-batch measures, from the same policy (every update above was restored)
        _staleness(ctx, *stale_batch, rl_steps + batches, sorted(set(staleness)), meas)
        bar.update(max(staleness))
    bar.close()
    m = torch.cat(margins).double() if margins else torch.zeros(0)
    rows = meas.rows(K * ctx.controller.num_layers)
    for row in rows:
        row["predicted_change"] = predicted_change(m, row["scale"], K) if row["kind"] == "logit_noise" else None
    return {
        "config": {"family": ctx.cfg.model.family, "experts": ctx.controller.num_experts, "top_k": K, "layers": ctx.controller.num_layers,
                   "aux": ctx.cfg.model.router_aux_loss_coef, "task": ctx.cfg.task.name, "objective": ctx.cfg.objective.name,
                   "mini_batches": M, "batches": batches, "rl_steps": rl_steps, "lr": ctx.cfg.trainer.lr,
                   "staleness": sorted(set(staleness)),
                   "router_lr_scale": ctx.cfg.trainer.router_lr_scale},
        "router": {
            **{f"margin_{k}": v for k, v in margin_summary(m).items()},
            "load_cv": float(torch.stack([x["cv"] for x in loads]).mean()),
            "dead_frac": float(torch.stack([x["dead_frac"] for x in loads]).mean()),
        },
        "rows": rows,
    }


def matched(result: dict, target: float) -> dict[str, float]:
    """Per injection kind, the scale whose expert change is nearest `target` on a log-log interpolation."""
    out = {}
    for kind in {r["kind"] for r in result["rows"]} - {"natural"}:
        pts = sorted((r["expert_change"], r["scale"]) for r in result["rows"] if r["kind"] == kind)
        pts = [(c, s) for c, s in pts if c > 0]
        for (c0, s0), (c1, s1) in zip(pts, pts[1:], strict=False):
            if c0 <= target <= c1 and c1 > c0:
                t = (math.log(target) - math.log(c0)) / (math.log(c1) - math.log(c0))
                out[kind] = math.exp(math.log(s0) + t * (math.log(s1) - math.log(s0)))
    return out


def write(result: dict, out: Path) -> None:
    """calibration.json, calibration.md and calibration.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(result, indent=1, allow_nan=False, default=str))
    write_report(result, out)


def write_report(result: dict, out: Path) -> None:
    """calibration.md (tables) and calibration.png (change against scale; |Δ log π| at matched change)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, r = result["rows"], result["router"]
    natural = [x for x in rows if x["kind"] == "natural"]
    lines = [f"# Calibration: {result['config']}", "",
             f"Router margins z_(k) - z_(k+1): median {r['margin_median']:.3f}, p10 {r['margin_p10']:.3f}, "
             f"{100 * r['margin_frac_below']:.1f}% below 0.1; load CV {r['load_cv']:.2f}, dead experts "
             f"{100 * r['dead_frac']:.1f}%.", "",
             "Every \\|Δlogp\\| is what routing replay removes (routing-only); the whole update's damage is beside "
             "the natural and stale rows; per changed expert: mean \\|Δlogp\\| / (change x K x L).", "",
             "| injection | scale | expert change | mean \\|Δlogp\\| | p99 \\|Δlogp\\| | per changed expert "
             "| whole update's mean \\|Δlogp\\| | predicted by margins |",
             "|---|---|---|---|---|---|---|---|"]
    names = {"natural": "natural (one update, lr)", "stale": "stale (k RL steps)"}
    for x in sorted(rows, key=lambda x: (x["kind"], x["scale"])):
        pred = "" if x["predicted_change"] is None else f"{100 * x['predicted_change']:.2f}%"
        per = x.get("dlogp_per_changed_expert")
        whole = x.get("whole_dlogp_mean")
        lines.append(f"| {names.get(x['kind'], x['kind'])} | {x['scale']:g} | {100 * x['expert_change']:.2f}% "
                     f"| {x['dlogp_mean']:.4f} | {x['dlogp_p99']:.3f} | {'' if per is None else f'{per:.2e}'} "
                     f"| {'' if whole is None else f'{whole:.4f}'} | {pred} |")
    lines += ["", "Scale matching an expert change (log-log interpolation between measured scales):", "",
              "| target | " + " | ".join(k for k in KINDS) + " |", "|---|" + "---|" * len(KINDS)]
    targets = [(f"natural, lr {x['scale']:g} ({100 * x['expert_change']:.2f}%)", x["expert_change"]) for x in natural]
    for name, target in [*targets, ("the paper's ~10%", 0.10)]:
        m = matched(result, target)
        lines.append(f"| {name} | " + " | ".join(f"{m[k]:.3g}" if k in m else "out of range" for k in KINDS) + " |")
    (out / "calibration.md").write_text("\n".join(lines) + "\n")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind in KINDS:
        pts = sorted((x["scale"], x["expert_change"], x["dlogp_mean"], x["dlogp_p99"]) for x in rows if x["kind"] == kind)
        if not pts:
            continue
        sc, ch, mean, p99 = zip(*pts, strict=True)
        a.plot(sc, ch, "o-", label=kind)
        line = b.plot(ch, mean, "o-", label=f"{kind}: mean")[0]
        b.plot(ch, p99, "s--", color=line.get_color(), alpha=0.6, label=f"{kind}: p99")
    for x in natural:
        b.plot([x["expert_change"]] * 2, [x["dlogp_mean"], x["dlogp_p99"]], "k*", ms=12)
    b.plot([], [], "k*", ms=12, label="natural (one update)")
    stale = sorted((x["expert_change"], x["dlogp_mean"]) for x in rows if x["kind"] == "stale")
    if stale:
        b.plot(*zip(*stale, strict=True), "kD-", ms=5, label="stale (k RL steps)")
    a.set(xscale="log", yscale="log", xlabel="scale (p, σ or σ_w)", ylabel="expert change",
          title="Expert change against injected scale")
    b.set(xscale="log", yscale="log", xlabel="expert change", ylabel="|Δ log π| (mean, p99)",
          title="Log-prob damage at matched expert change")
    b.axvline(0.10, color="grey", ls=":", lw=1)
    for ax in (a, b):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out / "calibration.png", dpi=110)
    plt.close(fig)
    if any(x["kind"] == "stale" for x in rows):
        plot_staleness(rows, out / "staleness.png")


def plot_staleness(rows: list[dict], path: Path) -> None:
    """Expert change, and the replay-removable and whole damage, against k RL steps of staleness, beside
    the GSPO paper's "~10% of activated experts change after one update"."""
    import matplotlib.pyplot as plt

    pts = sorted((x["scale"], x["expert_change"], x["dlogp_mean"], x["whole_dlogp_mean"]) for x in rows
                 if x["kind"] == "stale")
    k, change, removable, whole = zip(*pts, strict=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(k, [100 * c for c in change], "o-", label="sampler (k steps old) vs proximal policy")
    a.axhline(10, color="grey", ls=":", label="GSPO paper: ~10% after one update (48-layer Qwen3-30B-A3B)")
    a.set(xscale="log", xlabel="staleness k (RL steps)", ylabel="expert change (%)", title="Expert change against staleness")
    b.plot(k, removable, "o-", label="what replay removes: |log π(θ_k, r(θ_k)) − log π(θ_k, r(θ_0))|")
    b.plot(k, whole, "s--", label="whole: |log π(θ_k, r(θ_k)) − log π(θ_0, r(θ_0))|")
    b.set(xscale="log", yscale="log", xlabel="staleness k (RL steps)", ylabel="mean |Δ log π| per token",
          title="Log-prob damage against staleness")
    for ax in (a, b):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(results: list[tuple[str, dict]]) -> str:
    """One markdown row per calibration (name, calibration.json): the policy's routers and its natural
    expert change and |Δ log π| after one update at each lr, the damage per point of change (mean |Δ log π| /
    change in %, the figure section 9 of docs/results.md compares instruments by), and the logit-noise rows'
    measured against predicted change. `router lr x` is trainer.router_lr_scale (1 in calibrations that
    predate it)."""
    lrs = sorted({r["scale"] for _, res in results for r in res["rows"] if r["kind"] == "natural"})
    head = ["policy", "experts / top-k / layers", "aux", "router lr x", "margin median", "p10", "< 0.1", "load CV", "dead",
            *[f"change, lr {lr:g}" for lr in lrs], *[f"mean \\|Δlogp\\|, lr {lr:g}" for lr in lrs],
            *[f"\\|Δlogp\\| per point, lr {lr:g}" for lr in lrs], "logit noise: σ, measured / predicted",
            "logit noise per point / natural's at the nearest change: σ: ratio (lr)",
            "logit noise per changed expert / natural's at the training lr: σ: ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, res in results:
        c, r = res["config"], res["router"]
        nat = {x["scale"]: x for x in res["rows"] if x["kind"] == "natural"}
        noise = [x for x in res["rows"] if x["kind"] == "logit_noise"]
        cells = [name, f"{c['experts']} / {c['top_k']} / {c['layers']}", f"{c['aux']:g}",
                 f"{c.get('router_lr_scale', 1.0):g}", f"{r['margin_median']:.3f}", f"{r['margin_p10']:.3f}", f"{100 * r['margin_frac_below']:.0f}%",
                 f"{r['load_cv']:.2f}", f"{100 * r['dead_frac']:.0f}%",
                 *[f"{100 * nat[lr]['expert_change']:.2f}%" if lr in nat else "" for lr in lrs],
                 *[f"{nat[lr]['dlogp_mean']:.4f}" if lr in nat else "" for lr in lrs],
                 *[damage_per_point(nat.get(lr)) for lr in lrs],
                 ", ".join(f"{x['scale']:g}: {100 * x['expert_change']:.1f}% / {100 * x['predicted_change']:.1f}%"
                           for x in noise),
                 ", ".join(f"{x['scale']:g}: {ratio:.2f} ({lr:g})" for x in noise
                           for ratio, lr in [noise_vs_natural(x, list(nat.values()))] if math.isfinite(ratio)),
                 ", ".join(f"{x['scale']:g}: {ratio:.2f}" for x in noise
                           for ratio in [noise_vs_training_lr(x, nat.get(c["lr"]))] if math.isfinite(ratio))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def noise_vs_natural(noise: dict, natural: list[dict]) -> tuple[float, float]:
    """(ratio, lr): an injection row's damage per point of expert change (mean |Δ log π| / change) over the
    natural update's at the lr whose change after one update is nearest the injection's (on a log scale);
    1 means it damages as natural re-routing does per changed expert. (nan, nan) without a comparable row."""
    usable = [r for r in natural if r["expert_change"] > 0 and r["dlogp_mean"] > 0]
    if noise["expert_change"] <= 0 or not usable:
        return math.nan, math.nan
    near = min(usable, key=lambda r: abs(math.log(r["expert_change"] / noise["expert_change"])))
    ratio = (noise["dlogp_mean"] / noise["expert_change"]) / (near["dlogp_mean"] / near["expert_change"])
    return ratio, near["scale"]


def noise_vs_training_lr(noise: dict, natural: dict | None) -> float:
    """An injection row's damage per changed expert over the natural update's at the training lr (its row
    at trainer.lr): both routing-only, what replay removes; 1 means noise damages per changed expert as
    natural re-routing at the lr the runs train with does. nan without that row or without a change. Rows
    written before `dlogp_per_changed_expert` existed give the same ratio from damage per point of change
    (K and L cancel)."""
    if natural is None or noise["expert_change"] <= 0 or natural["expert_change"] <= 0 or natural["dlogp_mean"] <= 0:
        return math.nan
    return (noise["dlogp_mean"] / noise["expert_change"]) / (natural["dlogp_mean"] / natural["expert_change"])


def damage_per_point(row: dict | None) -> str:
    """Mean |Δ log π| per percentage point of expert change ('' without the row or with no change)."""
    if row is None or row["expert_change"] <= 0:
        return ""
    return f"{row['dlogp_mean'] / (100 * row['expert_change']):.4f}"


def _summarize(folders: list[Path], out: Path) -> None:
    """`--summarize`: calibration_summary.md and .json over several calibration folders."""
    missing = [str(f) for f in folders if not (f / "calibration.json").is_file()]
    if missing:
        sys.exit(f"moe-rl-calibrate: no calibration.json in {', '.join(missing)}")
    results = [(f.name, json.loads((f / "calibration.json").read_text())) for f in folders]
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration_summary.md").write_text(summary_table(results))
    (out / "calibration_summary.json").write_text(json.dumps(dict(results), indent=1, allow_nan=False))
    print(f"{len(results)} calibrations summarised in {out}/calibration_summary.md")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    from moe_rl.train import CONF_DIR, to_config

    parser = argparse.ArgumentParser(prog="moe-rl-calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for moe-rl-train")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, default=2, help="rollout batches to pool (default 2)")
    parser.add_argument("--lrs", type=_floats, default=None, help="lrs of the natural update (default trainer.lr)")
    parser.add_argument("--rl-steps", type=int, default=5,
                        help="real RL steps at trainer.lr before calibrating, so the optimizer has state (default 5)")
    parser.add_argument("--staleness", type=lambda t: [int(x) for x in t.split(",") if x.strip()], default=[],
                        help="k values (RL steps) of a staleness trajectory: change and damage after k steps")
    for kind, default in DEFAULTS.items():
        parser.add_argument(f"--{kind.replace('_', '-')}", type=_floats, default=default, dest=kind)
    parser.add_argument("--summarize", type=Path, nargs="+", metavar="DIR",
                        help="instead of calibrating: one table over these calibration folders, into --out")
    args = parser.parse_args(argv)
    if args.summarize:
        _summarize(args.summarize, args.out)
        return
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        try:
            cfg = to_config(compose(config_name="config", overrides=args.overrides))
        except ValueError as err:
            sys.exit(f"moe-rl-calibrate: {err}")
    if perturbs(cfg.routing):
        sys.exit("moe-rl-calibrate: calibrate a clean policy: leave routing.drift, logit_noise, weight_noise at 0 "
                 "and routing.replay=off (each injection is applied by the calibration itself)")
    if args.batches < 1 or args.rl_steps < 0:
        sys.exit(f"moe-rl-calibrate: --batches={args.batches} must be >= 1, --rl-steps={args.rl_steps} >= 0")
    if any(k < 1 for k in args.staleness):
        sys.exit(f"moe-rl-calibrate: --staleness={args.staleness}: every k must be >= 1")
    ctx, _ = build_context(cfg)
    scales = {k: getattr(args, k) for k in DEFAULTS}
    result = calibrate(ctx, args.batches, args.lrs or [cfg.trainer.lr], scales, args.rl_steps, args.staleness)
    write(result, args.out)
    print(f"calibration of {result['config']} written to {args.out}/calibration.md")


if __name__ == "__main__":
    main()
