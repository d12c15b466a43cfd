"""Sampler throughput: tokens/s of batched KV-cache sampling, with and without routing recording.

    python experiments/bench/sampler_throughput.py                 # batch 256, 32 new tokens, tiny model
    python experiments/bench/sampler_throughput.py --batch 64 --new-tokens 16 --threads 2

EOS is suppressed so every row samples exactly --new-tokens tokens. Conditions are interleaved and the
median of --repeats runs is reported, as side-by-side ratios within one run.
"""

import argparse
import statistics
import time

import torch

from moe_rl.models import ModelConfig, build_model, build_tokenizer
from moe_rl.rollout import SamplerConfig, sample
from moe_rl.routing import RoutingController


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tok = build_tokenizer()
    model = build_model(ModelConfig(), tok)
    ctl = RoutingController(model)
    prompts = [f"{i % 10}+{(i * 7) % 10}=" for i in range(args.batch)]
    cfg = SamplerConfig(max_new_tokens=args.new_tokens, suppress_eos=True)
    times: dict[str, list[float]] = {"plain": [], "record": []}
    for r in range(args.repeats + 1):  # the first round warms up
        for name, controller in (("plain", None), ("record", ctl)):
            t = time.perf_counter()
            sample(model, tok, prompts, cfg, generator=torch.Generator().manual_seed(r), controller=controller)
            if r:
                times[name].append(time.perf_counter() - t)
    tokens = args.batch * args.new_tokens
    plain, record = statistics.median(times["plain"]), statistics.median(times["record"])
    print(f"batch {args.batch} x {args.new_tokens} new tokens, {args.threads} threads, median of {args.repeats}")
    print(f"| condition | seconds | tokens/s |\n|---|---|---|\n| plain | {plain:.3f} | {tokens / plain:.0f} |")
    print(f"| record routing | {record:.3f} | {tokens / record:.0f} |\nrecord / plain = {record / plain:.3f}")


if __name__ == "__main__":
    main()
