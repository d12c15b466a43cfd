"""Router probe: how decisive and how balanced are a warm-started policy's routers?

For each model preset x warm-start arm, this builds (or loads from the cache) the warm start a run with
those overrides would start from, teacher-forces `--n` held-out prompts with their canonical answers
(prompt + task.solve + EOS, the warm start's demonstrations) through it, records every router's logits with
the `RoutingController`, and reports over every non-padding token (prompts and answers):

| column | formula |
|---|---|
| `cv` | load coefficient of variation std/mean of tokens per expert (`expert_load`), mean over layers (and per layer in the JSON) |
| `dead` | experts with no token at all (`expert_load`'s `dead_frac`), mean over layers |
| `dead<s` | experts whose load is below s x the uniform load (`dead_expert_fraction`, s = `--dead-share`) |
| `margin med`, `margin p10` | median / 10th percentile of z_(k) - z_(k+1), the k-th minus (k+1)-th router logit (`router_margins`), pooled over tokens and layers |
| `<0.1` | fraction of those margins below 0.1 |
| `logit sd` | median over tokens and layers of the std of the E router logits: the scale margins are read against |
| `steps`, `pre`, `acc`, `build s` | band-search steps, pretraining steps, held-out accuracy of the warm start, seconds its build took (from warmstart.json when cached) |

Run from the repo root (CPU, 2 threads per build, as every warm start):

    OMP_NUM_THREADS=1 python experiments/router_probe.py --models tiny fine \\
        --cache-dir /tmp/router-probe-cache --out /tmp/router_probe.json
    # arms are "label=override,override"; the defaults are these three:
    python experiments/router_probe.py --arms "aux0=" "aux0.01=model.router_aux_loss_coef=0.01" \\
        "pre50+aux0.01=warmstart.pretrain_steps=50,model.router_aux_loss_coef=0.01"

Any Hydra override of the run config works in an arm or in `--overrides` (applied to every arm), e.g.
`--overrides task=sort`. The warm starts are those a run with the same overrides and cache dir would use.
`--data broad` teacher-forces the broad pretraining mixture (`BroadTask`, every family and difficulty)
instead of the run's task: experts a pretrained model keeps for other families idle on one task, so the
two tell domain specialisation from collapse.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer

from moe_rl.models import build_model
from moe_rl.rollout import position_ids_from_mask
from moe_rl.routing import (
    RoutingController,
    dead_expert_fraction,
    expert_load,
    margin_summary,
    router_margins,
)
from moe_rl.tasks import TASKS, BroadTask, make_task
from moe_rl.train import to_config
from moe_rl.warmstart import META_FILE, demonstration_batch, warm_start

# Shape legend: B prompts, S tokens (prompt + answer + EOS, right-padded), L layers, E experts, K top-k.

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
DEFAULT_ARMS = (
    "aux0=",
    "aux0.01=model.router_aux_loss_coef=0.01",
    "pre50+aux0.01=warmstart.pretrain_steps=50,model.router_aux_loss_coef=0.01",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Router statistics of warm-started policies.")
    p.add_argument("--models", nargs="+", default=["tiny", "fine"], help="conf/model presets")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), help='"label=override,override"')
    p.add_argument("--overrides", nargs="*", default=[], help="overrides applied to every arm")
    p.add_argument("--cache-dir", default="/tmp/router-probe-cache")
    p.add_argument("--n", type=int, default=256, help="held-out prompts to teacher-force")
    p.add_argument("--dead-share", type=float, default=0.1)
    p.add_argument("--data", choices=["task", "broad"], default="task",
                   help="teacher-force the run's task (default) or the broad pretraining mixture")
    p.add_argument("--out", default=None, help="JSON file for every number (per layer too)")
    return p.parse_args()


def router_stats(trace, mask_BS: torch.Tensor, top_k: int, dead_share: float) -> dict:
    """The probe's statistics of one recorded trace (module docstring's table)."""
    load = expert_load(trace, mask_BS)
    margin_BSL = router_margins(trace.router_logits_BTLE, top_k)
    margin_NL = margin_BSL[mask_BS.bool()]
    return dict(
        cv=float(load["cv"].mean()),
        cv_by_layer=load["cv"].tolist(),
        dead=float(load["dead_frac"].mean()),
        dead_share=float(dead_expert_fraction(load["tokens_per_expert"], dead_share).mean()),
        dead_share_by_layer=dead_expert_fraction(load["tokens_per_expert"], dead_share).tolist(),
        margin=margin_summary(margin_NL),
        margin_median_by_layer=[margin_summary(m_N)["median"] for m_N in margin_NL.T],
        logit_sd=float(trace.router_logits_BTLE[mask_BS.bool()].double().std(-1).median()),
    )


def probe(model_name: str, label: str, arm: list[str], args: argparse.Namespace) -> dict:
    """Build or load one warm start, teacher-force the held-out demonstrations, return its statistics."""
    overrides = [f"model={model_name}", f"warmstart.cache_dir={args.cache_dir}", *args.overrides, *arm]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=overrides))
    start = time.perf_counter()
    ws = warm_start(
        cfg.model, cfg.task.name, cfg.task.difficulty, cfg.warmstart,
        cfg.seed if cfg.warmstart.build_seed is None else cfg.warmstart.build_seed,
        mix=cfg.task.mix, max_new_tokens=cfg.sampler.max_new_tokens, progress=True, device="cpu",
    )
    wall = time.perf_counter() - start
    meta = json.loads((Path(ws.path) / META_FILE).read_text())
    model = build_model(dataclasses.replace(cfg.model, pretrained=ws.path))
    tokenizer = AutoTokenizer.from_pretrained(ws.path)
    task = make_task(cfg.task.name, cfg.task.difficulty, cfg.task.mix) if args.data == "task" else BroadTask(TASKS)
    ids_BS, mask_BS, _ = demonstration_batch(tokenizer, task, task.examples("eval", args.n, cfg.eval.seed))
    ctl = RoutingController(model)
    with torch.no_grad(), ctl.record(with_logits=True) as rec:
        model(input_ids=ids_BS, attention_mask=mask_BS, position_ids=position_ids_from_mask(mask_BS))
    stats = router_stats(rec.trace, mask_BS, ctl.top_k, args.dead_share)
    return dict(
        model=model_name, arm=label, data=args.data, overrides=overrides, path=ws.path, cached=ws.cached,
        accuracy=ws.accuracy, steps=ws.steps, pretrain_steps=meta.get("pretrain_steps", 0),
        build_seconds=meta["seconds"], wall_seconds=wall, experts=ctl.num_experts, top_k=ctl.top_k,
        tokens=int(mask_BS.sum()), **stats,
    )


def table(rows: list[dict], dead_share: float) -> str:
    """The rows as a markdown table (the module docstring's columns)."""
    head = (f"| model | E/k | arm | cv | dead | dead<{dead_share:g} | margin med | margin p10 | <0.1 | logit sd "
            "| steps | pre | acc | build s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        m = r["margin"]
        lines.append(
            f"| {r['model']} | {r['experts']}/{r['top_k']} | {r['arm']} | {r['cv']:.2f} | {r['dead']:.2f} | "
            f"{r['dead_share']:.2f} | {m['median']:.3f} | {m['p10']:.3f} | {m['frac_below']:.2f} | "
            f"{r['logit_sd']:.3f} | {r['steps']} | {r['pretrain_steps']} | {r['accuracy']:.2f} | {r['build_seconds']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    rows = []
    for model_name in args.models:
        for spec in args.arms:
            label, _, rest = spec.partition("=")
            rows.append(probe(model_name, label, [o for o in rest.split(",") if o], args))
            print(table(rows[-1:], args.dead_share).splitlines()[-1], flush=True)
    print(table(rows, args.dead_share))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
