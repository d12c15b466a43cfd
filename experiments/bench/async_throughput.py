"""Overlapped rollouts (rollout.overlap, staleness 1) against the synchronous loop, and TRL, on this machine's cores.

    python experiments/bench/async_throughput.py --out bench_out/async.json     # tiny, 64 experts, TRL (~10 min)
    python experiments/bench/async_throughput.py --only tiny --steps 3 --no-trl  # a quick look

Workload: the reference of experiments/bench/workload.py (32 prompts x 8 completions of exactly 32 tokens,
4 mini-batches, GSPO, fp32, routing recorded), on two models: `tiny` (its 4 layers of 8 experts top-2) and
`experts64` (64 experts top-8 of expert FFN 32, the fine-grained shape). Conditions:

- `sync`: rollout.staleness = 0, today's loop: sample, old-policy forward, train, every torch op on all cores;
- `overlap`: rollout.staleness = 1 with rollout.overlap: a background thread samples step t + 1 with the
  weights step t starts from while the trainer trains step t, the cores split between them
  (moe_rl.trainer.stale.thread_split: the sampler half, the trainer the rest);
- `trl` (tiny only, with the bench extra): TRL 1.16's GRPOTrainer on the same workload (trl_side.py).

An overlapped loop cannot alternate step by step with another system (its sampler thread would keep
running into the other's step), so conditions run in blocks, in the order sync, overlap, trl, trl,
overlap, sync (ABCCBA: a linear drift of the machine cancels in each condition's mean). Each block builds
its system from the same seed, runs one warm-up RL step, then times --steps steps by the wall clock;
its throughput is steps / seconds. RL steps per hour is a condition's mean over its two blocks; samples
trained per hour is that times the samples per step (prompts x completions, the same in every condition,
so the ratios at equal samples trained equal the ratios of RL steps). Ratios are of those means,
measured side by side in this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import trl_side
from workload import AdditionTask, Workload, config, prompts_and_answers

from moe_rl.trainer.run import build_context
from moe_rl.trainer.stale import thread_split
from moe_rl.trainer.step import rl_step

MODELS = {"tiny": {}, "experts64": {"experts": 64, "top_k": 8, "expert_ffn": 32}}
CONDITIONS = ("sync", "overlap")
ORDER = ("sync", "overlap", "trl", "trl", "overlap", "sync")


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def moe_rl_block(w: Workload, condition: str, steps: int) -> dict[str, float]:
    """One block of `condition`: a fresh run of 1 + `steps` RL steps; the timed steps' wall seconds."""
    cfg = config(w)
    cfg.trainer.steps = steps + 2  # the sampler may run one step ahead of the last trained one
    if condition == "overlap":
        cfg.rollout.staleness, cfg.rollout.overlap = 1, True
        trainer_threads, sampler_threads = thread_split(0, 0)
    else:
        trainer_threads, sampler_threads = cores(), 0
    torch.set_num_threads(trainer_threads)
    ctx, _ = build_context(cfg)
    ctx.task = AdditionTask(1)
    try:
        rl_step(ctx, 0)  # warm-up: the first rollout (and, overlapped, the sampler thread's start)
        started = time.perf_counter()
        for step in range(1, steps + 1):
            rl_step(ctx, step)
        seconds = time.perf_counter() - started
    finally:
        ctx.sampler.close()
        torch.set_num_threads(cores())
    return {"seconds": seconds, "steps": steps, "trainer_threads": trainer_threads, "sampler_threads": sampler_threads}


def trl_block(w: Workload, steps: int) -> dict[str, float]:
    """TRL's GRPOTrainer for 1 + `steps` RL steps of `w` on the same initial model; the timed steps' seconds."""
    from transformers import TrainerCallback

    ctx, _ = build_context(config(w))
    prompts, answers = prompts_and_answers(w.prompts * (steps + 1))
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step % w.mini_batches == 0:  # an RL step is its mini_batches optimizer steps
                marks.append(time.perf_counter())

    torch.set_num_threads(cores())
    trl_side.build_trainer(ctx.model, ctx.tokenizer, prompts, answers, w, steps + 1, [Clock()]).train()
    return {"seconds": marks[-1] - marks[0], "steps": len(marks) - 1, "trainer_threads": cores(), "sampler_threads": 0}


def measure(w: Workload, steps: int, trl: bool) -> dict:
    """Every block of ORDER (TRL's left out without `trl`), and each condition's throughput and ratios."""
    blocks = []
    for condition in ORDER:
        if condition == "trl" and not trl:
            continue
        b = trl_block(w, steps) if condition == "trl" else moe_rl_block(w, condition, steps)
        b.update(condition=condition, steps_per_hour=3600 * b["steps"] / b["seconds"])
        print(f"  {condition}: {b['seconds'] / b['steps']:.3f} s per RL step", flush=True)
        blocks.append(b)
    samples = w.prompts * w.group
    out: dict = {"blocks": blocks, "samples_per_step": samples, "conditions": {}}
    for condition in dict.fromkeys(b["condition"] for b in blocks):
        rates = [b["steps_per_hour"] for b in blocks if b["condition"] == condition]
        mean = statistics.fmean(rates)
        out["conditions"][condition] = {"steps_per_hour": mean, "samples_per_hour": mean * samples,
                                        "s_per_step": 3600 / mean, "blocks": rates}
    c = out["conditions"]
    out["ratio"] = {"overlap/sync": c["overlap"]["steps_per_hour"] / c["sync"]["steps_per_hour"]}
    if "trl" in c:
        for name in CONDITIONS:
            out["ratio"][f"{name}/trl"] = c[name]["steps_per_hour"] / c["trl"]["steps_per_hour"]
    return out


def markdown(report: dict) -> str:
    w = report["workload"]
    lines = [
        "# Overlapped rollouts against the synchronous loop",
        "",
        f"Workload: {w['prompts']} prompts x {w['group']} completions x {w['new_tokens']} tokens, "
        f"{w['mini_batches']} mini-batches, {w['layers']} layers, {w['objective']}, {w['dtype']}; {report['cores']} "
        f"cores; {report['steps']} timed RL steps per block after one warm-up, blocks in the order "
        f"{', '.join(ORDER)}. torch {report['torch']}.",
        "",
        "| model | condition | threads (trainer + sampler) | s / RL step | RL steps / hour | samples trained / hour | per block (steps / hour) |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, m in report["models"].items():
        for name, c in m["conditions"].items():
            b = next(b for b in m["blocks"] if b["condition"] == name)
            threads = f"{b['trainer_threads']} + {b['sampler_threads']}" if name == "overlap" else str(b["trainer_threads"])
            per = ", ".join(f"{r:.0f}" for r in c["blocks"])
            lines.append(f"| {model} | {name} | {threads} | {c['s_per_step']:.3f} | {c['steps_per_hour']:.0f} "
                         f"| {c['samples_per_hour']:.0f} | {per} |")
    lines += ["", "| model | ratio | value |", "|---|---|---|"]
    for model, m in report["models"].items():
        lines += [f"| {model} | {name} | **{r:.2f}x** |" for name, r in m["ratio"].items()]
    return "\n".join(lines + [""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="timed RL steps per block (after 1 warm-up)")
    p.add_argument("--only", default=",".join(MODELS), help=f"models, of {', '.join(MODELS)}")
    p.add_argument("--prompts", type=int, default=Workload.prompts)
    p.add_argument("--new-tokens", type=int, default=Workload.new_tokens)
    p.add_argument("--no-trl", action="store_true", help="leave TRL out (it needs the bench extra)")
    p.add_argument("--out", default="bench_out/async.json")
    args = p.parse_args()
    base = Workload(prompts=args.prompts, new_tokens=args.new_tokens)
    report: dict = {"workload": base.__dict__, "cores": cores(), "steps": args.steps, "torch": torch.__version__,
                    "models": {}}
    for model in args.only.split(","):
        print(f"{model}:", flush=True)
        trl = model == "tiny" and not args.no_trl
        report["models"][model] = {"workload": {**base.__dict__, **MODELS[model]},
                                   **measure(base.replace(**MODELS[model]), args.steps, trl)}
    if "trl" in next(iter(report["models"].values()))["conditions"]:
        report["trl_version"] = __import__("trl").__version__
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
