"""Before/after equality of whole RL runs: the harness that guards a restructuring of the trainer.

    python experiments/step_equivalence.py against <base-commit>          # both trees, then compare
    python experiments/step_equivalence.py snapshot <root> <out.json>      # one tree's fingerprints
    python experiments/step_equivalence.py compare <before.json> <after.json>
    ... against <base> --new-keys mismatch/k3_kl,mismatch/js_divergence   # metrics the change adds

For each preset, a 2-step run (`python -m moe_rl.train`, the real entry point, with `PYTHONPATH=<root>`)
is fingerprinted: the sha256 of every final parameter (policy/*.safetensors, the exported policy), every row of metrics.jsonl
and events.jsonl with the timing keys (`time/*`, `throughput/*`) removed, and the summary's collapse
events. `compare` demands exact equality: a move that changes one bit is a bug, not a re-baseline. A
change that adds metrics names them with `--new-keys` (exact keys, comma-separated): those keys, and only
those, may appear in the after rows alone, and every other key and value must still be equal.

Every run uses one thread (trainer.threads=1, OMP_NUM_THREADS=1) and one shared warm-start cache, so the
fingerprints depend on the code alone. Presets run two at a time. `ddp` runs under torchrun with two
processes; `vllm` only where vLLM is installed (`--presets vllm` with the vLLM environment's Python; it is
reported as skipped elsewhere).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BASE = [
    "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.mini_batches=2",
    "trainer.threads=1", "trainer.checkpoint_every=1", "sampler.max_new_tokens=6", "model.num_layers=2",
    "logger.progress=false", "logger.wandb=false", "eval.size=16", "eval.expected_size=16", "eval.at_start=true",
    "eval.every=1", "warmstart.target_low=0.1", "warmstart.target_high=0.9", "warmstart.eval_every=10",
    "warmstart.eval_size=64",
]
PRESETS: dict[str, list[str]] = {
    "grpo_bf16_sampler": ["objective=grpo", "trainer.sampler_dtype=bfloat16"],
    "grpo_r2_bf16_sampler": ["objective=grpo_rr", "trainer.sampler_dtype=bfloat16"],
    "grpo_r3_bf16_sampler": ["objective=grpo_r3", "trainer.sampler_dtype=bfloat16"],
    "gspo": ["objective=gspo"],
    "sapo": ["objective=sapo"],
    "noise_update": ["objective=grpo", "routing.logit_noise=0.3", "trainer.mini_batches=4"],
    "noise_trainer": ["objective=grpo_rr", "routing.logit_noise=0.3", "routing.noise_scope=trainer", "routing.noise_growth=constant"],
    "drift": ["objective=grpo", "routing.drift=0.2"],
    "reuse_sampler_logp": ["objective=grpo", "trainer.reuse_sampler_logp=true"],
    "dataset": ["task=dataset", "warmstart.enabled=false", "objective=grpo",
                "task.reward_fn=equivalence_rewards:by_text"],
    "rspo_weight_noise": ["objective=rspo", "routing.weight_noise=0.001"],
    "tis_kl_bf16": ["objective=grpo_tis", "objective.beta=0.05", "trainer.sampler_dtype=bfloat16"],
    "gspo_token_bf16_master": ["objective=gspo_token", "model.dtype=bfloat16", "trainer.master_weights=true"],
    "ddp": ["objective=grpo_rr", "trainer.parallel=ddp"],
    "vllm": ["objective=grpo_r3", "sampler.engine=vllm"],
    # issue 53's rivals and options
    "vespo_tis_bf16": ["objective=vespo", "objective.rollout_is=token_truncate", "trainer.sampler_dtype=bfloat16"],
    "luspo": ["objective=luspo"],
    "dppo_prime": ["objective=dppo_prime"],
    "dppo_topk_stale": ["objective=dppo_topk_kl", "rollout.staleness=1"],
    "partial_replay_ess": ["objective=grpo_rr", "routing.replay_score_ratio=0.5", "trainer.ess_step_scale=sqrt",
                           "trainer.sampler_dtype=bfloat16"],
    "router_recall": ["objective=grpo_r3", "routing.replay_gates=true", "routing.freeze_router=true"],
}
DISTRIBUTED = {"ddp"}
NEEDS_VLLM = {"vllm"}
TIMING = ("time/", "throughput/")
REWARDS = '''
def by_text(prompt, response, example):
    """A reward that varies within a group, so that the untrained policy's advantages are not all 0."""
    return (sum(map(ord, response)) % 3) / 2
'''
"""task.reward_fn of the `dataset` preset (its untrained policy never answers right): imported from the
folder the run starts in, as a user's reward module is."""


def _untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


def fingerprint(run_dir: Path) -> dict:
    """What must not change: final parameters (sha256 each), metrics and events without timings."""
    import torch
    from safetensors.torch import load_file

    state = {k: v for f in sorted((run_dir / "policy").glob("*.safetensors")) for k, v in load_file(f).items()}
    params = {
        name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, t in sorted(state.items())
    }
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    events_path = run_dir / "events.jsonl"
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line] if events_path.exists() else []
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "params": params,
        "metrics": [_untimed(r) for r in rows],
        "events": events,
        "collapse_events": summary["collapse_events"],
        "steps_done": summary["steps_done"],
    }


def _command(name: str, root: Path, run_dir: Path, cache: Path) -> list[str]:
    overrides = [*BASE, *PRESETS[name], f"warmstart.cache_dir={cache}", f"hydra.run.dir={run_dir}"]
    if "task=dataset" in PRESETS[name]:  # the worked example of the tree under test
        overrides.append(f"task.path={root / 'examples' / 'gsm_style.jsonl'}")
    if name in DISTRIBUTED:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "moe_rl.train", *overrides]
    return [sys.executable, "-m", "moe_rl.train", *overrides]


def _run(root: Path, name: str, work: Path, cache: Path) -> dict:
    if name in NEEDS_VLLM and importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed in this environment"}
    run_dir = work / name
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    (work / "equivalence_rewards.py").write_text(REWARDS)
    proc = subprocess.run(_command(name, root, run_dir, cache), cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"preset {name} failed in {root}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return fingerprint(run_dir)


def snapshot(root: str, out: str, presets: list[str], cache: str | None = None) -> dict:
    """Run every preset with the code under `root`; write and return {preset: fingerprint}."""
    root_path = Path(root).resolve()
    with tempfile.TemporaryDirectory(prefix="equivalence-") as tmp:
        work = Path(tmp)
        cache_path = Path(cache) if cache else work / "warmstart"
        # The warm start first, alone: every preset that uses it then reads the same cache entry.
        first = [p for p in presets if p not in DISTRIBUTED and p not in NEEDS_VLLM and "warmstart.enabled=false"
                 not in PRESETS[p]][:1]
        results = {p: _run(root_path, p, work, cache_path) for p in first}
        rest = [p for p in presets if p not in first]
        # Two single-process presets at a time; torchrun's two processes run alone, after them.
        with ThreadPoolExecutor(max_workers=2) as pool:
            single = [p for p in rest if p not in DISTRIBUTED]
            for name, result in zip(single, pool.map(lambda p: _run(root_path, p, work, cache_path), single),
                                    strict=True):
                results[name] = result
        for name in (p for p in rest if p in DISTRIBUTED):
            results[name] = _run(root_path, name, work, cache_path)
    Path(out).write_text(json.dumps({p: results[p] for p in presets}, indent=1, sort_keys=True))
    return results


def _first_difference(a, b, where: str = "") -> str | None:
    if type(a) is not type(b):
        return f"{where}: {a!r} != {b!r}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{where}/{key}: only in {'after' if key not in a else 'before'}"
            diff = _first_difference(a[key], b[key], f"{where}/{key}")
            if diff:
                return diff
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} entries before, {len(b)} after"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            diff = _first_difference(x, y, f"{where}[{i}]")
            if diff:
                return diff
        return None
    return None if a == b else f"{where}: {a!r} before, {b!r} after"


def without_new_keys(fingerprint: dict, new_keys: set[str]) -> dict:
    """The fingerprint with the named metric keys dropped from every metric row (the after side of a change
    that adds them)."""
    if not new_keys or "metrics" not in fingerprint:
        return fingerprint
    return {**fingerprint, "metrics": [{k: v for k, v in row.items() if k not in new_keys}
                                       for row in fingerprint["metrics"]]}


def compare(before: dict, after: dict, new_keys: set[str] = frozenset()) -> list[str]:
    """One line per preset: `equal`, `skipped (...)` or its first difference. Returns the lines. `new_keys`:
    metric keys the change adds, dropped from the after rows before the comparison (a key of them that the
    before rows also hold is still compared)."""
    lines = []
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a is not None and b is not None and "metrics" in a:
            b = without_new_keys(b, new_keys - set().union(*a["metrics"]))
        if a is None or b is None:
            lines.append(f"{name}: only {'after' if a is None else 'before'}")
        elif "skipped" in a or "skipped" in b:
            lines.append(f"{name}: skipped ({a.get('skipped') or b.get('skipped')})")
        else:
            diff = _first_difference(a, b)
            n = len(a["params"])
            lines.append(f"{name}: equal ({n} parameters, {len(a['metrics'])} metric rows, "
                         f"{len(a['metrics'][0]) if a['metrics'] else 0} keys per row)" if diff is None
                         else f"{name}: DIFFERS at {diff}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    snap = sub.add_parser("snapshot")
    snap.add_argument("root")
    snap.add_argument("out")
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("before")
    cmp_.add_argument("after")
    against = sub.add_parser("against", help="snapshot <base> (git archive) and this tree, then compare")
    against.add_argument("base")
    for p in (cmp_, against):
        p.add_argument("--new-keys", default="", help="comma-separated metric keys the change adds")
    for p in (snap, against):
        p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated (default: all)")
        p.add_argument("--cache", default=None, help="warm-start cache shared by both trees (default: a temp dir)")
    args = parser.parse_args(argv)
    new_keys = set(filter(None, getattr(args, "new_keys", "").split(",")))
    if args.cmd == "compare":
        lines = compare(json.loads(Path(args.before).read_text()), json.loads(Path(args.after).read_text()),
                        new_keys)
    else:
        presets = args.presets.split(",")
        unknown = sorted(set(presets) - set(PRESETS))
        if unknown:
            parser.error(f"unknown presets {unknown}; known: {sorted(PRESETS)}")
        if args.cmd == "snapshot":
            snapshot(args.root, args.out, presets, args.cache)
            return 0
        here = Path(__file__).resolve().parents[1]
        with tempfile.TemporaryDirectory(prefix="equivalence-base-") as tmp:
            base = Path(tmp) / "tree"
            base.mkdir()
            archive = subprocess.run(["git", "-C", str(here), "archive", args.base], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
            cache = args.cache or str(Path(tmp) / "warmstart")
            before = snapshot(str(base), str(Path(tmp) / "before.json"), presets, cache)
            after = snapshot(str(here), str(Path(tmp) / "after.json"), presets, cache)
        lines = compare(before, after, new_keys)
    print("\n".join(lines))
    return 0 if all(": equal" in line or ": skipped" in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
