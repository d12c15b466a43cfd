"""vLLM sampling throughput at 1 and 2 ranks on this machine: one engine in one process against an engine per
rank under torchrun, side by side in one run. Run it with the vLLM environment's Python:

    .venv-vllm/bin/python experiments/bench/vllm_ranks.py --fsdp --out bench_out/vllm_ranks.json   # ~8 min
    .venv-vllm/bin/python experiments/bench/vllm_ranks.py --steps 2 --repeats 1               # a quick look

Workload: the reference of experiments/bench/workload.py's shape through the real entry point
(`python -m moe_rl.train`): 32 prompts x 8 completions of exactly 32 tokens (EOS suppressed), the tiny
model without a warm start, fp32, GRPO + R3 (so the taps' routes are replayed), no eval. Conditions:

- `1 rank`: one process, one engine, trainer.threads = all cores;
- `2 ranks`: torchrun with 2 processes (gloo), an engine per rank, each rank sampling half the rows,
  trainer.threads = cores / 2 each;
- `2 ranks fsdp` (with --fsdp): the same under trainer.parallel=fsdp, where each rank gathers the full
  weights (an all-gather per parameter) before it syncs its engine.

Each block runs --steps RL steps; step 0 (the engines' first forwards) is dropped. Blocks run in the
order A B (C) (C) B A, repeated --repeats / 2 times: a linear drift of the machine cancels. Per block: rollout seconds
per step (`time/rollout_s`, the slowest rank's), sampled tokens per second of rollout wall time (all ranks'
response tokens / `time/rollout_s`), weight-sync seconds (`time/weight_sync_s`, the slowest rank's) and
whole steps per hour (`time/step_s`). The engines' start-up is reported from the runs' logs of it, once.
Ratios are over the 1-rank condition, of the medians over blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = [
    "sampler.engine=vllm", "objective=grpo_r3", "trainer.prompts_per_step=32", "trainer.group_size=8",
    "trainer.mini_batches=4", "sampler.max_new_tokens=32", "sampler.suppress_eos=true", "warmstart.enabled=false",
    "eval.size=0", "eval.expected_size=0", "logger.progress=false", "logger.wandb=false", "trainer.checkpoint_every=0",
    "trainer.dist_timeout_s=600",
]


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


CONDITIONS = {"1 rank": (1, "ddp"), "2 ranks": (2, "ddp"), "2 ranks fsdp": (2, "fsdp")}


def block(condition: str, steps: int, folder: Path) -> dict[str, float]:
    """One run of `steps` RL steps of `condition`; medians over its steps after the first."""
    ranks, parallel = CONDITIONS[condition]
    threads = max(1, cores() // ranks)
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    cmd = [sys.executable, *launch, "-m", "moe_rl.train", *WORKLOAD, f"trainer.steps={steps}",
           f"trainer.threads={threads}", f"trainer.parallel={parallel}", f"hydra.run.dir={folder}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{condition} block failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()][1:]
    tokens = 32 * 8 * 32  # every row samples exactly max_new_tokens (EOS suppressed)
    med = lambda key: statistics.median(float(r[key]) for r in rows)  # noqa: E731
    return {"rollout_s": med("time/rollout_s"), "sampled_tokens_per_s": tokens / med("time/rollout_s"),
            "weight_sync_s": med("time/weight_sync_s"), "steps_per_hour": 3600 / med("time/step_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="RL steps per block (the first is dropped)")
    parser.add_argument("--repeats", type=int, default=2, help="blocks per condition (even: ABBA order)")
    parser.add_argument("--fsdp", action="store_true", help="also 2 ranks under trainer.parallel=fsdp")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here too")
    args = parser.parse_args()
    names = [*CONDITIONS][: 3 if args.fsdp else 2]
    order = [c for i in range(args.repeats) for c in (names if i % 2 == 0 else names[::-1])]
    blocks: dict[str, list[dict[str, float]]] = {c: [] for c in names}
    with tempfile.TemporaryDirectory(prefix="moe-rl-bench-") as tmp:
        for i, condition in enumerate(order):
            blocks[condition].append(block(condition, args.steps, Path(tmp) / str(i)))
            print(f"block {i + 1}/{len(order)}: {condition} {blocks[condition][-1]}", flush=True)
    table = {c: {k: statistics.median(b[k] for b in bs) for k in bs[0]} for c, bs in blocks.items()}
    ratio = {c: {k: table[c][k] / table[names[0]][k] for k in table[c]} for c in names[1:]}
    print(f"\n{cores()} cores, {args.steps - 1} timed steps per block, {args.repeats} blocks per condition\n")
    print("| condition | rollout s / step | sampled tokens / s | weight sync s | RL steps / hour |")
    print("|---|---|---|---|---|")
    for c, row in table.items():
        print(f"| {c} | {row['rollout_s']:.2f} | {row['sampled_tokens_per_s']:.0f} | {row['weight_sync_s']:.3f} "
              f"| {row['steps_per_hour']:.0f} |")
    for c, r in ratio.items():
        print(f"| {c} / {names[0]} | {r['rollout_s']:.2f}x | {r['sampled_tokens_per_s']:.2f}x | "
              f"{r['weight_sync_s']:.2f}x | {r['steps_per_hour']:.2f}x |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cores": cores(), "steps": args.steps, "repeats": args.repeats,
                                        "workload": WORKLOAD, "blocks": blocks, "median": table, "ratio": ratio},
                                       indent=2))


if __name__ == "__main__":
    main()
