"""RL-step benchmark: where one RL step's time goes, what routing costs, the compute floor, scaling, TRL.

    python experiments/bench/rl_step.py                          # stages, overheads, floor (~2 min)
    pip install -e ".[bench]"                                    # TRL 1.16, for --trl
    python experiments/bench/rl_step.py --trl --scaling --profile --out bench_out/rl_step.json

The workload is issue #7's reference (experiments/bench/workload.py): tiny Qwen3-MoE, 32 prompts x 8
completions of exactly 32 tokens, 4 mini-batches, GSPO, fp32, routing recorded. Writes a JSON file, a
markdown report next to it and, with --scaling, a PNG.

Method: every condition gets its own policy built from the same seed; conditions run interleaved, one RL
step each in turn, so they share machine conditions; each number is a median over --steps steps after
one warm-up step. Ratios are of medians measured side by side in this one run.
- stages: seconds per RL step split into sampling (+ rewards), old-policy forward and training
  (M optimizer steps); sampler tokens/s; trained response tokens/s; the process's peak RSS.
- overheads: routing record in the sampler and in the old-policy forward, and replay in a training
  forward + backward, each against the same call without it; the replay cache's bytes per token.
- floor: floor.py, the step's matmuls timed alone at their shapes.
- --trl: trl_side.py, TRL's GRPOTrainer paired step by step with moe-rl, and both systems' GSPO and
  GRPO losses on identical inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import resource
import statistics
import time
from pathlib import Path

import torch
import trl_side
from floor import MatmulLog, floor_seconds
from routing_overhead import median_seconds
from workload import Workload, context, prompts_and_answers

from moe_rl.objectives import group_advantages
from moe_rl.rollout import response_logprobs, sample
from moe_rl.trainer.step import rl_step

CONDITIONS = {
    "default": {},
    "reuse_sampler_logp": {"reuse_sampler_logp": True},
    "eager_experts": {"experts_impl": "eager"},
    "replay_old": {"replay": "old"},
}
"""Benchmarked variants of the workload: moe-rl's defaults (grouped_mm experts); skipping the old-policy
forward (sampler log-probs reused); transformers' eager experts loop (the default before this
benchmark); Routing Replay."""

SCALING = {"group": (4, 8, 16), "new_tokens": (16, 32, 64), "layers": (2, 4, 8), "experts": (4, 8, 16)}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def stages(w: Workload, names: list[str], steps: int) -> dict[str, dict[str, float]]:
    """Median stage times of each condition, interleaved step by step."""
    ctxs = {n: context(w.replace(**CONDITIONS[n])) for n in names}
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for step in range(steps + 1):
        for n, ctx in ctxs.items():
            m = rl_step(ctx, step)
            if step:
                runs[n].append(m)
    B = w.prompts * w.group
    out = {}
    for n, ms in runs.items():
        med = {k: _median([m[k] for m in ms]) for k in ms[0] if k.startswith(("time/", "throughput/"))}
        response_tokens = B * _median([m["rollout/response_len/mean"] for m in ms])
        out[n] = {
            "step_s": med["time/step_s"],
            "sample_s": med["time/rollout_s"],
            "old_forward_s": med["time/old_forward_s"],
            "train_s": med["time/train_s"],
            "sampler_tokens_per_s": med["throughput/sampler_tokens_per_s"],
            "train_tokens_per_s": response_tokens / med["time/train_s"],
        }
    return out


def overheads(w: Workload, reps: int) -> dict[str, float]:
    """Routing record / replay costs as ratios against the same call without them."""
    ctx = context(w)
    model, tok, ctl, cfg = ctx.model, ctx.tokenizer, ctx.controller, ctx.cfg.sampler
    prompts = [p for p in prompts_and_answers(w.prompts)[0] for _ in range(w.group)]
    gen = torch.Generator()

    def sampler(controller):
        return lambda: sample(model, tok, prompts, cfg, generator=gen.manual_seed(0), controller=controller)

    t_sample = median_seconds({"plain": sampler(None), "record": sampler(ctl)}, reps, warmup=1)
    roll = sample(model, tok, prompts, cfg, generator=gen.manual_seed(0), controller=ctl)
    ids, att, R = roll.input_ids_BS, roll.attention_mask_BS, roll.response_ids_BR.shape[1]

    def old_forward(record: bool):
        def fn():
            with torch.no_grad(), ctl.record(with_logits=True) if record else contextlib.nullcontext():
                response_logprobs(model, ids, att, R)

        return fn

    t_old = median_seconds({"plain": old_forward(False), "record": old_forward(True)}, reps, warmup=1)
    b = len(prompts) // w.mini_batches
    mb_ids, mb_att, trace = ids[:b], att[:b], roll.routing.rows(slice(0, b))

    def train(replay: bool):
        def fn():
            with ctl.replay(trace) if replay else contextlib.nullcontext():
                logp = response_logprobs(model, mb_ids, mb_att, R)
            logp.sum().backward()
            model.zero_grad(set_to_none=True)

        return fn

    t_train = median_seconds({"plain": train(False), "replay": train(True)}, reps, warmup=1)
    tokens = roll.routing.shape[0] * roll.routing.shape[1]
    return {
        "sampler_record_ratio": t_sample["record"] / t_sample["plain"],
        "old_forward_record_ratio": t_old["record"] / t_old["plain"],
        "train_replay_ratio": t_train["replay"] / t_train["plain"],
        "replay_cache_bytes_per_token": roll.routing.expert_ids_BTLK.nbytes / tokens,
        "sampler_plain_s": t_sample["plain"],
        "old_forward_plain_s": t_old["plain"],
        "train_minibatch_plain_s": t_train["plain"],
    }


def floor(w: Workload) -> dict[str, float]:
    """The compute floor of one RL step of `w` (after a warm-up step)."""
    ctx = context(w)
    rl_step(ctx, 0)
    with MatmulLog() as log:
        rl_step(ctx, 1)
    return floor_seconds(log, w.device)


def scaling(w: Workload, steps: int) -> dict[str, list[dict[str, float]]]:
    """Median step time (default condition) at 3 points along each of group, length, layers, experts."""
    out: dict[str, list[dict[str, float]]] = {}
    for axis, values in SCALING.items():
        out[axis] = []
        for v in values:
            s = stages(w.replace(**{axis: v}), ["default"], steps)["default"]
            out[axis].append({"value": v, **s})
            print(f"scaling {axis}={v}: {s['step_s']:.3f} s/step", flush=True)
    return out


def growth_exponents(points: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """Log-log slope of step time between each axis's smallest and largest point (1 = linear)."""
    return {
        axis: math.log(p[-1]["step_s"] / p[0]["step_s"]) / math.log(p[-1]["value"] / p[0]["value"])
        for axis, p in points.items()
    }


def plot_scaling(points: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(points), figsize=(4 * len(points), 3.4))
    for ax, (axis, p) in zip(axes, points.items(), strict=True):
        x = [q["value"] for q in p]
        bottom = [0.0] * len(p)
        for key, label in (
            ("sample_s", "sampling"),
            ("old_forward_s", "old forward"),
            ("train_s", "training"),
        ):
            y = [q[key] for q in p]
            ax.bar([str(v) for v in x], y, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, y, strict=True)]
        linear = [p[0]["step_s"] * v / x[0] for v in x]
        ax.plot([str(v) for v in x], linear, "k--", label="linear from first point")
        ax.set_xlabel(axis)
        ax.set_ylabel("seconds per RL step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def profile_top(w: Workload, rows: int = 15) -> str:
    """torch.profiler's top entries (self CPU time) of one RL step after a warm-up step."""
    from torch.profiler import ProfilerActivity, profile

    ctx = context(w)
    rl_step(ctx, 0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        rl_step(ctx, 1)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def trl_comparison(
    w: Workload, pairs: int, variants: tuple[str, ...] = ("default", "reuse_sampler_logp")
) -> dict:
    """TRL paired with each moe-rl variant (all from the same initial weights), then the losses compared."""
    ctxs = {name: context(w.replace(**CONDITIONS[name])) for name in variants}
    ctx = next(iter(ctxs.values()))
    init_model = copy.deepcopy(ctx.model)
    prompts, answers = prompts_and_answers(w.prompts * (pairs + 1))
    step = dict.fromkeys(variants, 0)

    def runner(name: str):
        def run() -> float:
            t = time.perf_counter()
            rl_step(ctxs[name], step[name])
            step[name] += 1
            return time.perf_counter() - t

        return run

    trl_model = copy.deepcopy(init_model)
    paired = trl_side.paired_steps(
        trl_model, ctx.tokenizer, prompts, answers, w, pairs, {n: runner(n) for n in variants}
    )
    group_prompts = [p for p in prompts[: w.prompts] for _ in range(w.group)]
    roll = sample(
        init_model, ctx.tokenizer, group_prompts, ctx.cfg.sampler, generator=torch.Generator().manual_seed(0)
    )
    adv = group_advantages(torch.randn(len(roll.texts), generator=torch.Generator().manual_seed(1)), w.group)
    return {
        **paired,
        "median_s": {k: _median(v) for k, v in paired["seconds"].items()},
        "median_ratio": {k: _median(v) for k, v in paired["ratio"].items()},
        "losses": trl_side.compare_losses(init_model, ctx.tokenizer, roll, adv, w),
        "trl_version": __import__("trl").__version__,
    }


def markdown(report: dict) -> str:
    w = report["workload"]
    lines = [
        "# RL-step benchmark",
        "",
        f"Workload: {w['prompts']} prompts x {w['group']} completions x {w['new_tokens']} tokens, "
        f"{w['mini_batches']} mini-batches, {w['layers']} layers, {w['experts']} experts top-{w['top_k']}, "
        f"{w['objective']}, {w['dtype']} on {w['device']}, {report['threads']} threads; medians of "
        f"{report['steps']} steps. torch {report['torch']}.",
        "",
        "| condition | s / RL step | sampling | old forward | training | sampler tok/s | train tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in report["stages"].items():
        lines.append(
            f"| {name} | {s['step_s']:.3f} | {s['sample_s']:.3f} | {s['old_forward_s']:.3f} | "
            f"{s['train_s']:.3f} | {s['sampler_tokens_per_s']:.0f} | {s['train_tokens_per_s']:.0f} |"
        )
    lines += [
        "",
        f"Peak RSS of the benchmark process: {report['peak_rss_mib']:.0f} MiB.",
        "",
    ]
    if "overheads" in report:
        o = report["overheads"]
        lines += [
            "| routing cost | ratio to the same call without it |",
            "|---|---|",
            f"| record in the sampler | {o['sampler_record_ratio']:.3f} |",
            f"| record (with logits) in the old-policy forward | {o['old_forward_record_ratio']:.3f} |",
            f"| replay in a training forward + backward | {o['train_replay_ratio']:.3f} |",
            "",
            f"Replay cache: {o['replay_cache_bytes_per_token']:.0f} bytes per token.",
            "",
        ]
    if "floor" in report:
        f = report["floor"]
        lines += [
            f"Compute floor (reuse_sampler_logp): {f['floor_s']:.3f} s per RL step = {f['flops'] / 1e9:.1f} "
            f"GFLOP of matmuls at {f['matmul_gflops_per_s']:.0f} GFLOP/s (their {f['distinct_shapes']:.0f} "
            f"shapes timed alone). Distance: {report['floor_distance']:.2f}x.",
            "",
        ]
    if "trl" in report:
        t = report["trl"]
        lines += [
            f"TRL {t['trl_version']} GRPOTrainer paired with moe-rl, {len(t['seconds']['trl'])} rounds "
            f"(TRL step, then one step of each moe-rl variant): TRL {t['median_s']['trl']:.3f} s per RL step.",
            "",
            "| moe-rl variant | s / RL step | TRL / moe-rl (median of pairs) |",
            "|---|---|---|",
        ]
        lines += [f"| {k} | {t['median_s'][k]:.3f} | **{r:.2f}x** |" for k, r in t["median_ratio"].items()]
        lines += [
            "",
            "| loss on identical inputs | TRL | moe-rl | abs diff |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['trl']:.8f} | {v['moe_rl']:.8f} | {v['abs_diff']:.1e} |"
            for k, v in t["losses"].items()
        ]
        lines.append("")
    if "scaling" in report:
        lines += ["| axis | values | s / RL step | growth exponent (1 = linear) |", "|---|---|---|---|"]
        for axis, p in report["scaling"].items():
            vals = ", ".join(str(q["value"]) for q in p)
            secs = ", ".join(f"{q['step_s']:.2f}" for q in p)
            lines.append(f"| {axis} | {vals} | {secs} | {report['growth'][axis]:.2f} |")
        lines.append("")
    if "profile" in report:
        lines += [
            "Profile before (eager experts, old forward), one RL step:",
            "",
            "```",
            report["profile_before"],
        ]
        lines += [
            "```",
            "",
            "Profile after (grouped_mm experts, reuse_sampler_logp):",
            "",
            "```",
            report["profile"],
        ]
        lines += ["```", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Workload):
        kind = type(f.default)
        parse = (lambda s: s.lower() in ("1", "true", "yes")) if kind is bool else kind
        p.add_argument(f"--{f.name.replace('_', '-')}", type=parse, default=f.default)
    p.add_argument("--steps", type=int, default=5, help="timed RL steps per condition (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--conditions", default=",".join(CONDITIONS))
    p.add_argument("--trl", action="store_true", help="TRL side by side (needs the bench extra)")
    p.add_argument("--scaling", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--out", default="bench_out/rl_step.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    w = Workload(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Workload)})
    report: dict = {
        "workload": dataclasses.asdict(w),
        "threads": args.threads,
        "steps": args.steps,
        "torch": torch.__version__,
    }
    report["stages"] = stages(w, args.conditions.split(","), args.steps)
    report["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # after the stages
    print(json.dumps(report["stages"], indent=1), flush=True)
    report["overheads"] = overheads(w, args.steps)
    if not args.no_floor:
        report["floor"] = floor(w.replace(reuse_sampler_logp=True))
        best = min(s["step_s"] for s in report["stages"].values())
        report["floor_distance"] = best / report["floor"]["floor_s"]
    if args.trl:
        report["trl"] = trl_comparison(w, args.steps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.scaling:
        report["scaling"] = scaling(w, max(1, args.steps // 2))
        report["growth"] = growth_exponents(report["scaling"])
        plot_scaling(report["scaling"], out.with_suffix(".png"))
    if args.profile:  # before: the previous defaults (eager experts, old forward); after: this PR's best
        report["profile_before"] = profile_top(w.replace(**CONDITIONS["eager_experts"]))
        report["profile"] = profile_top(w.replace(**CONDITIONS["reuse_sampler_logp"]))
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
