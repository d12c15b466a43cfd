"""The vLLM engine against the hf engine: what a real inference engine's kernels add to the sampler/trainer
mismatch, judged on a sweep that crosses `sampler.engine` with the replay arm and the sampler's precision
(experiments/reproduce.sh replay_source_vllm).

A cell is (arm, sampler precision): the arm is the run's label (objective preset and replay source), the
precision `trainer.sampler_dtype` (fp32 when null: the trained model's). In each cell, per engine, the mean
over seeds (± 95% t-CI half-width) of each run's mean over steps of:

| column | metric |
|---|---|
| mismatch | `mismatch/logp_abs_diff/mean`: mean |log π_sampler − log π_old| over response tokens, as the objective sees it |
| routing vs old | `routing/rollout_vs_old/frac`: fraction of the sampler's activated experts the old-policy forward did not choose |
| weight sync (s) | `time/weight_sync_s` (absent when the sampler is the trained model itself) |

and the final held-out accuracy (analysis.pairs.final_eval). Each vLLM − hf difference is paired by seed
(paired t; a seed's warm start, prompts and eval set are shared by both engines, though their samples differ);
the sentence under each says whether it is distinguishable from seed noise (analysis.stats.verdict).
Under R3 the old-policy forward replays the sampler's routing, so "routing vs old" is its free choice given
the replayed layers above, not comparable to the value without replay.
"""

from __future__ import annotations

import math
from typing import Any

from analysis.drift import plain
from analysis.load import Run
from analysis.pairs import final_eval
from analysis.sections import Section, doc_intro
from analysis.stats import Difference, MeanCI, mean_ci, paired_t, short_verdict, verdict

ENGINES = ("hf", "vllm")
OUTCOMES = {
    "mismatch": "mismatch/logp_abs_diff/mean",
    "routing vs old": "routing/rollout_vs_old/frac",
    "weight sync (s)": "time/weight_sync_s",
}


def applies(runs: list[Run]) -> bool:
    """Whether the runs cross both engines."""
    return {str(r.flat.get("sampler.engine", "hf")) for r in runs} >= set(ENGINES)


def _cells(runs: list[Run]) -> dict[tuple[str, str], dict[str, dict[int, Run]]]:
    cells: dict[tuple[str, str], dict[str, dict[int, Run]]] = {}
    for run in runs:
        precision = run.flat.get("trainer.sampler_dtype") or "fp32"
        precision = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(precision, precision)
        engine = str(run.flat.get("sampler.engine", "hf"))
        cells.setdefault((run.base_label, precision), {}).setdefault(engine, {})[run.seed] = run
    return dict(sorted(cells.items()))


def engine_table(runs: list[Run]) -> list[dict[str, Any]]:
    """One row per (arm, precision): per engine, each outcome's per-seed values and mean ± CI, and the
    vLLM − hf difference paired by seed."""
    rows = []
    for (arm, precision), engines in _cells(runs).items():
        if not set(ENGINES) <= set(engines):
            continue
        seeds = sorted(set(engines["hf"]) & set(engines["vllm"]))
        row: dict[str, Any] = {"arm": arm, "precision": precision, "seeds": seeds, "outcomes": {}}
        measures = {name: (lambda r, k=key: r.mean(k)) for name, key in OUTCOMES.items()}
        measures["final eval acc"] = final_eval
        for name, measure in measures.items():
            per_seed = {e: [measure(engines[e][s]) for s in seeds] for e in ENGINES}
            out = {e: {"per_seed": v, "mean_ci": mean_ci(v)} for e, v in per_seed.items()}
            both = all(math.isfinite(x) for v in per_seed.values() for x in v)
            out["diff"] = paired_t(per_seed["vllm"], per_seed["hf"]) if both and len(seeds) > 1 else None
            row["outcomes"][name] = out
        rows.append(row)
    return rows


def _cell(m: MeanCI) -> str:
    if not math.isfinite(m.mean):
        return "—"
    return f"{m.mean:.3g} ± {m.half:.2g}" if math.isfinite(m.half) else f"{m.mean:.3g}"


def _diff(d: Difference | None) -> str:
    """A difference at the scale of its values (mismatches are 1e-7 to 1e-2): three significant digits."""
    if d is None or not math.isfinite(d.diff):
        return "—"
    return f"{d.diff:+.3g} [{d.lo:+.3g}, {d.hi:+.3g}], p = {d.p:.2g}"


def format_engines(table: list[dict[str, Any]]) -> str:
    """The table as markdown: per outcome, hf and vLLM means and their paired difference, then verdicts."""
    names = list(OUTCOMES) + ["final eval acc"]
    head = "| arm | sampler | seeds | " + " | ".join(f"{n}: hf | {n}: vLLM | {n}: vLLM − hf" for n in names) + " |"
    lines = [head, "|" + "---|" * (3 + 3 * len(names))]
    notes = []
    for row in table:
        cells = [row["arm"], row["precision"], str(len(row["seeds"]))]
        for name in names:
            o = row["outcomes"][name]
            cells += [_cell(o["hf"]["mean_ci"]), _cell(o["vllm"]["mean_ci"]), _diff(o["diff"])]
            if o["diff"] is not None and name in ("mismatch", "final eval acc"):
                notes.append(f"- {row['arm']}, {row['precision']}, {name}: {short_verdict(verdict(o['diff']))}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + notes)


def engines_json(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table with every number as plain JSON (differences as dicts)."""
    return [plain(row) for row in table]


SECTION = Section(
    name="engines",
    heading="vLLM engine against hf engine",
    intro=doc_intro(__doc__),
    file="engines.md",
    applies=lambda sweep: applies(sweep.runs),
    compute=lambda sweep: engine_table(sweep.runs) or None,
    markdown=format_engines,
    json=lambda table: {"engines": engines_json(table)},
)
