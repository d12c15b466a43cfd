"""Routing overhead: what recording and replaying MoE routing costs on a model forward, side by side.

Run from the repo root (CPU; the project installed, or `PYTHONPATH=.`):

    python experiments/bench/routing_overhead.py                   # tiny default model, B=64, T=64
    python experiments/bench/routing_overhead.py --grad --layers 8 --experts 32 --top-k 4

Each condition is timed as the median over `--repeats` of wall-clock seconds per call. Every repeat runs
each condition once, round-robin, so machine noise hits all of them alike.

| condition | what one call does | baseline |
|---|---|---|
| `plain` | forward of a model with no `RoutingController` (hooks never registered) | `plain` |
| `hooks_idle` | forward of an identical model with a controller attached and no context open | `plain` |
| `record` | forward inside `record()`, then building `rec.trace` (what a caller pays) | `plain` |
| `record_logits` | the same with `record(with_logits=True)` | `plain` |
| `replay` | forward inside `replay(trace)` of a trace recorded beforehand | `plain` |
| `plain_fwd_bwd` | `--grad`: forward + backward of the LM loss, no controller | `plain_fwd_bwd` |
| `replay_fwd_bwd` | `--grad`: the same inside `replay(trace)` (replayed training) | `plain_fwd_bwd` |

Reported per condition: `median_seconds`, `ratio_vs_baseline` = median / the baseline's median, and
`tokens_per_s` = B*T / median. Also `trace_bytes_per_token`: the recorded trace's bytes / (B*T), ids only
(L*K for up to 256 experts) and with float32 logits (+ 4*L*E). Forward-only conditions run under
`torch.no_grad()`. The table is printed and written as JSON to `--out` and as markdown next to it (`.md`).
"""

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from moe_rl.models import ModelConfig, build_model, build_tokenizer
from moe_rl.routing import RoutingController

# Shape legend: B batch rows, T tokens per row.


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Time routing record/replay against a plain forward.")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--grad", action="store_true", help="also time forward+backward, plain vs replay")
    p.add_argument("--layers", type=int, help="override ModelConfig.num_layers")
    p.add_argument("--experts", type=int, help="override ModelConfig.num_experts")
    p.add_argument("--top-k", type=int, help="override ModelConfig.top_k")
    p.add_argument("--hidden", type=int, help="override ModelConfig.hidden_size")
    p.add_argument("--out", type=Path, default=Path("bench_out/routing_overhead.json"))
    return p.parse_args()


def make_conditions(args, cfg: ModelConfig):
    """({name: zero-argument callable}, {name: baseline name}, {trace kind: bytes per token})."""
    tokenizer = build_tokenizer()
    plain_model = build_model(cfg, tokenizer)
    hooked_model = build_model(cfg, tokenizer)  # same seed, same weights; only this one carries hooks
    ctl = RoutingController(hooked_model)
    g = torch.Generator().manual_seed(0)
    input_ids_BT = torch.randint(
        len(tokenizer.all_special_tokens), len(tokenizer), (args.batch, args.seq), generator=g
    )

    def forward(model, ctx_factory):
        @torch.no_grad()
        def run():
            with ctx_factory():
                model(input_ids_BT)

        return run

    def forward_backward(model, ctx_factory):
        def run():
            with ctx_factory():
                model(input_ids_BT, labels=input_ids_BT).loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    def record(with_logits):
        @torch.no_grad()
        def run():
            with ctl.record(with_logits=with_logits) as rec:
                hooked_model(input_ids_BT)
            return rec.trace

        return run

    trace, trace_logits = record(False)(), record(True)()
    conditions = {
        "plain": forward(plain_model, contextlib.nullcontext),
        "hooks_idle": forward(hooked_model, contextlib.nullcontext),
        "record": record(False),
        "record_logits": record(True),
        "replay": forward(hooked_model, lambda: ctl.replay(trace)),
    }
    baselines = dict.fromkeys(conditions, "plain")
    if args.grad:
        conditions["plain_fwd_bwd"] = forward_backward(plain_model, contextlib.nullcontext)
        conditions["replay_fwd_bwd"] = forward_backward(hooked_model, lambda: ctl.replay(trace))
        baselines.update(plain_fwd_bwd="plain_fwd_bwd", replay_fwd_bwd="plain_fwd_bwd")
    n_tokens = args.batch * args.seq
    bytes_per_token = {"ids": trace.nbytes / n_tokens, "ids_and_logits": trace_logits.nbytes / n_tokens}
    return conditions, baselines, bytes_per_token


def median_seconds(conditions: dict, repeats: int, warmup: int) -> dict[str, float]:
    """Median wall-clock seconds per call of each condition, over interleaved repeats."""
    for _ in range(warmup):
        for run in conditions.values():
            run()
    seconds = {name: [] for name in conditions}
    for _ in tqdm(range(repeats), desc="repeats"):
        for name, run in conditions.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [
        f"Routing overhead: {c['family']}, L={c['num_layers']} E={c['num_experts']} K={c['top_k']} "
        f"H={c['hidden_size']}, B={c['batch']} T={c['seq']}, {c['threads']} threads, "
        f"median of {c['repeats']} interleaved repeats (torch {c['torch']}).",
        "",
        "| condition | median s | ratio vs baseline | tokens/s |",
        "|---|---:|---:|---:|",
    ]
    for name, r in report["conditions"].items():
        lines.append(
            f"| {name} | {r['median_seconds']:.4f} | {r['ratio_vs_baseline']:.3f} ({r['baseline']}) "
            f"| {r['tokens_per_s']:,.0f} |"
        )
    b = report["trace_bytes_per_token"]
    lines += ["", f"Trace bytes per token: {b['ids']:g} (ids), {b['ids_and_logits']:g} (ids + logits)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    overrides = dict(
        num_layers=args.layers, num_experts=args.experts, top_k=args.top_k, hidden_size=args.hidden
    )
    cfg = ModelConfig(**{k: v for k, v in overrides.items() if v is not None})
    conditions, baselines, bytes_per_token = make_conditions(args, cfg)
    medians = median_seconds(conditions, args.repeats, args.warmup)
    report = {
        "config": {
            k: getattr(cfg, k) for k in ("family", "num_layers", "num_experts", "top_k", "hidden_size")
        }
        | {k: getattr(args, k) for k in ("batch", "seq", "repeats", "warmup", "threads", "grad")}
        | {"torch": torch.__version__},
        "conditions": {
            name: {
                "median_seconds": s,
                "baseline": baselines[name],
                "ratio_vs_baseline": s / medians[baselines[name]],
                "tokens_per_s": args.batch * args.seq / s,
            }
            for name, s in medians.items()
        },
        "trace_bytes_per_token": bytes_per_token,
    }
    table = markdown(report)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
