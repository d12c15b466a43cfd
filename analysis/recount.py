"""Re-count a run's collapse events with the current detector, from its logged metrics (`moe-rl-analyze
--recount`): no new runs.

The two level tests (`reward_collapse`, `eval_regression`; moe_rl.trainer.changepoint) are replayed over
metrics.jsonl with the current `CollapseConfig` defaults (the run's own `collapse.warmup_steps`): a run
logged before the tests existed had other parameters under the same names, and those are not the rule
being counted. Events of the other kinds (`nonfinite`, `entropy_collapse`, `ratio_blowup`) did not change
rule and are kept from events.jsonl as they are. The rows' `collapse/events`, `collapse/new_events` and
`collapse/kind/*` are rewritten to match, so every table and test downstream counts the new events.

Noise scales for logs that predate them:
- `rollout/reward/se` absent: `rollout/reward/std` / sqrt(P), P = `trainer.prompts_per_step`. This is
  the standard error when every group's completions agree (intra-group correlation 1), the largest the
  group structure allows, so the replayed test is conservative there: fewer false alarms, later
  detection.
- `eval/expected_accuracy/se` absent: sqrt(m (1 − m) / N), N = `eval.expected_size`, the largest standard
  error a mean m of N values in [0, 1] can have; conservative likewise.
"""

from __future__ import annotations

import dataclasses
import math

from analysis.load import Run
from moe_rl.config import CollapseConfig
from moe_rl.trainer.collapse import KINDS, CollapseDetector, CollapseEvent, level_event

REPLAYED = ("reward_collapse", "eval_regression")
"""The kinds whose events the replay recomputes."""


def replayed_events(run: Run, cfg: CollapseConfig | None = None) -> list[CollapseEvent]:
    """The `reward_collapse` and `eval_regression` events the current rule finds in the run's rows."""
    cfg = cfg or CollapseConfig()
    flat = run.flat  # a folder without .hydra/config.yaml keeps only summary.json's fields: defaults then
    warmup = flat.get("collapse.warmup_steps", cfg.warmup_steps)
    det = CollapseDetector(dataclasses.replace(cfg, warmup_steps=warmup))
    # Unknown sizes give a NaN fallback error: those steps are then not observations.
    prompts = flat.get("trainer.prompts_per_step", math.nan)
    expected_size = flat.get("eval.expected_size", math.nan) or math.nan  # 0: expected accuracy was off
    for row in run.rows:
        step = int(row["step"])
        if step >= warmup and "rollout/reward/mean" in row:
            se = row.get("rollout/reward/se", row.get("rollout/reward/std", math.nan) / math.sqrt(prompts))
            x = row["rollout/reward/mean"]
            event = level_event(det.reward, step, "reward_collapse", x, se)
            det.events += [event] if event else []
        for prefix in ("eval/initial/", "eval/"):
            m = row.get(f"{prefix}expected_accuracy", math.nan)
            se = row.get(f"{prefix}expected_accuracy/se", math.sqrt(max(m * (1 - m), 0.0) / expected_size))
            det.observe_eval(step, {f"{prefix}expected_accuracy": m, f"{prefix}expected_accuracy/se": se}, prefix)
    return det.events


def recount(run: Run, cfg: CollapseConfig | None = None) -> Run:
    """The run with its replayed-kind events recomputed (module docstring) and its rows' counts to match."""
    kept = [e for e in (run.events or []) if e["kind"] not in REPLAYED]
    events = sorted(kept + [dataclasses.asdict(e) for e in replayed_events(run, cfg)], key=lambda e: e["step"])
    rows, i = [], 0
    for row in run.rows:
        step = int(row["step"])
        while i < len(events) and events[i]["step"] <= step:
            i += 1
        so_far = events[:i]
        row = {**row, "collapse/events": float(i), "collapse/new_events": float(sum(e["step"] == step for e in so_far))}
        row.update({f"collapse/kind/{k}": float(sum(e["kind"] == k for e in so_far)) for k in KINDS})
        rows.append(row)
    return dataclasses.replace(run, rows=rows, events=events)
