"""Load runs from a local sweep folder or from W&B into one in-memory form, and group them.

A `Run` is the run's full config (nested, as Hydra resolved it), its metrics rows (one dict per RL
step, exactly as in metrics.jsonl, NaN/inf as floats) and its collapse events. Both sources give the
same record, so the tables and figures never know where a run came from.

Grouping: a run's base label is its objective preset and replay source, read from its config (the
same string as `moe_rl.trainer.run.run_label`), never from folder names. Config fields that take more
than one value among runs with the same base label (a swept lr, model.num_layers, task.difficulty,
trainer.mini_batches, ...) are detected automatically and appended to the label. Seeds, logging and
device settings never split a group (see IGNORED): runs that differ only in those are averaged; nor does
the warm start's build seed (CLUSTER_FIELDS): warm starts are clusters within a group (analysis.clusters).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from analysis.compare import (
    COLUMNS,
    NOT_A_GROUP,
    NOT_A_GROUP_PREFIXES,
    BrokenRunError,
    read_run,
    run_row,
    set_aside,
    splits_groups,
)
from analysis.stats import finite_mean
from moe_rl.provenance import provenance_mismatch
from moe_rl.trainer.logging import CorruptLogError, read_jsonl

# Fields that never define a group (analysis.compare's list, shared with moe-rl-compare's table).
IGNORED = NOT_A_GROUP
IGNORED_PREFIXES = NOT_A_GROUP_PREFIXES
CLUSTER_FIELDS = frozenset({"warmstart.build_seed"})
"""Fields that say which warm start a run starts from: a sweep over them draws clusters (analysis.clusters),
not arms, so they never split a group here (moe-rl-compare's table still splits on them)."""


EVAL_PREFIX = "eval/"
"""Keys logged at eval steps only: a per-run table keeps their rows whole (analysis.runtable)."""
TOTALS = ("time/",)
"""The keys whose sum over steps a per-run table keeps (costs); `total` of any other raises for its runs."""
LASTS = ("collapse/",)
"""The keys whose final value a per-run table keeps (counters); `last` of any other raises for its runs."""


class NotInTableError(KeyError):
    """A per-step quantity asked of a run read from a per-run table, which keeps per-run quantities only."""


@dataclass
class Run:
    """One training run, whatever its source.

    What the analysis reads of a run's steps goes through `mean`, `total`, `last` and `summary` (per-run
    quantities) or `series` (a curve). A run read back from a per-run table (analysis.runtable) has its
    per-run quantities in `reduced` and only its eval rows in `rows`: the same answers, save `series` of a
    per-step key, which raises NotInTableError naming the key.
    """

    config: dict[str, Any]
    """The resolved config, nested like conf/ (objective.preset, routing.replay, trainer.lr, ...)."""
    rows: list[dict[str, float]]
    """metrics.jsonl: one dict per RL step with a "step" key; non-finite values are float nan/inf."""
    events: list[dict] | None
    """Collapse events (events.jsonl); None when the source does not keep them (W&B)."""
    source: str
    """Where it came from: the run folder, or the W&B run path."""
    provenance: dict[str, Any] | None = None
    """Versions, commit, CPU kernels, threads and device (moe_rl.provenance); None for a run that predates it."""
    reduced: dict[str, float] | None = None
    """From a per-run table: "mean:KEY", "total:KEY", "last:KEY" and "summary:COLUMN" (analysis.runtable)."""
    logged: frozenset[str] | None = None
    """From a per-run table: every key the run logged at some step."""

    @property
    def flat(self) -> dict[str, Any]:
        """The config with dotted keys ("trainer.lr")."""
        return flatten(self.config)

    @property
    def base_label(self) -> str:
        """Objective preset and replay source: the label moe_rl.trainer.run.run_label gives the run."""
        return f"{self.config['objective']['preset']} (replay={self.config['routing']['replay']})"

    @property
    def seed(self) -> int:
        return int(self.config["seed"])

    def _kept(self, key: str, prefixes: tuple[str, ...], what: str) -> None:
        if self.reduced is not None and not key.startswith(prefixes):
            raise NotInTableError(f"{self.source}: a per-run table keeps no {what} of {key!r} "
                                  "(moe-rl-archive fetch the sweep's records for it)")

    def series(self, key: str) -> np.ndarray:
        """The metric `key` over steps (nan where a step lacks it)."""
        self._kept(key, (EVAL_PREFIX,), "per-step curve")
        return np.array([_to_float(r.get(key, math.nan)) for r in self.rows], dtype=float)

    def keys(self) -> set[str]:
        """Every metric key logged at some step."""
        return set(self.logged) if self.logged is not None else {k for r in self.rows for k in r}

    def mean(self, key: str) -> float:
        """`key`'s mean over the run's steps, finite values only (nan when none is)."""
        if self.reduced is not None:
            return self.reduced.get(f"mean:{key}", math.nan)
        return finite_mean(self.series(key))

    def total(self, key: str) -> float:
        """`key`'s sum over the run's steps, non-finite values left out (0 when none is finite)."""
        self._kept(key, TOTALS, "sum over steps")
        if self.reduced is not None:
            return self.reduced.get(f"total:{key}", 0.0)
        return float(np.nansum(self.series(key)))

    def last(self, key: str, default: float = math.nan) -> float:
        """`key` in the run's final row; `default` when that row lacks it."""
        self._kept(key, LASTS, "final value")
        if self.reduced is not None:
            return self.reduced.get(f"last:{key}", default)
        return float(self.rows[-1].get(key, default)) if self.rows else default

    def summary(self) -> dict[str, float]:
        """moe-rl-compare's columns for this run (analysis.compare.run_row)."""
        if self.reduced is not None:
            return {column: self.reduced.get(f"summary:{column}", math.nan) for column in COLUMNS}
        return run_row(self.rows)


def _to_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {"a.b.c": value}; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def unflatten(config: dict[str, Any]) -> dict[str, Any]:
    """{"a.b": 1} -> {"a": {"b": 1}}; already nested dicts are merged (W&B may store either form)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf].update(unflatten(value))
        else:
            node[leaf] = unflatten(value) if isinstance(value, dict) else value
    return out


# --- local sweep folders ---------------------------------------------------------------------------


def find_run_dirs(sweep_dirs: Iterable[Path]) -> list[Path]:
    """Every folder under `sweep_dirs` (recursively, or the folder itself) with metrics.jsonl and summary.json.

    A folder with metrics.jsonl but no summary.json (a failed, killed or unfinished run), or with
    summary.json but no metrics.jsonl, is skipped with a warning naming it. FileNotFoundError (one
    line) for a path that is not a folder.
    """
    found: set[Path] = set()
    for root in sweep_dirs:
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: no such folder")
        for summary in root.rglob("summary.json"):
            if set_aside(summary.relative_to(root)):
                continue
            if not (summary.parent / "metrics.jsonl").exists():
                warnings.warn(f"skipping {summary.parent}: no metrics.jsonl", RuntimeWarning, stacklevel=2)
        for metrics in root.rglob("metrics.jsonl"):
            if set_aside(metrics.relative_to(root)):
                continue
            if (metrics.parent / "summary.json").exists():
                found.add(metrics.parent)
            else:
                warnings.warn(
                    f"skipping {metrics.parent}: no summary.json (failed, killed or unfinished)",
                    RuntimeWarning,
                    stacklevel=2,
                )
    return sorted(found)


def _config_from_summary(summary: dict) -> dict[str, Any]:
    """Fallback for a run folder without .hydra/config.yaml: the fields summary.json records."""
    return {
        "objective": {"preset": summary["objective"]},
        "routing": {"replay": summary["replay"]},
        "seed": summary["seed"],
        "experiment": summary.get("experiment", "default"),
    }


def read_local_run(run_dir: Path) -> Run:
    """One run folder written by moe-rl-train."""
    summary, rows = read_run(run_dir)
    hydra_cfg = run_dir / ".hydra" / "config.yaml"
    if hydra_cfg.exists():
        # A record is data: never resolve it. An interpolation such as ${oc.env:WANDB_API_KEY} in a config
        # that came from elsewhere (an archive) would read this machine's environment into every table.
        config = OmegaConf.to_container(OmegaConf.load(hydra_cfg), resolve=False)
        if kept := interpolations(config):
            warnings.warn(f"{hydra_cfg}: {', '.join(kept[:3])}{' ...' if len(kept) > 3 else ''} kept as written "
                          "(an interpolation in a record is not resolved)", RuntimeWarning, stacklevel=2)
    else:
        config = _config_from_summary(summary)
    events_path = run_dir / "events.jsonl"
    events = []
    if events_path.exists():
        events = read_jsonl(events_path)
    return Run(config=config, rows=rows, events=events, source=str(run_dir), provenance=summary.get("provenance"))


def interpolations(config: Any, prefix: str = "") -> list[str]:
    """The dotted keys of `config` (a plain container) whose value holds an unresolved `${...}`."""
    if isinstance(config, dict):
        return [k for key, v in config.items() for k in interpolations(v, f"{prefix}{key}.")]
    if isinstance(config, list):
        return [k for i, v in enumerate(config) for k in interpolations(v, f"{prefix}{i}.")]
    return [prefix.rstrip(".")] if isinstance(config, str) and "${" in config else []


def load_local(sweep_dirs: Iterable[Path], progress: bool = True) -> list[Run]:
    """Every run under the given sweep folders. Runs without any metrics row are skipped; so is a run
    whose files are corrupt, with a warning naming it (the rest of the sweep is still analysed)."""
    runs = []
    for d in tqdm(find_run_dirs(sweep_dirs), desc="loading runs", disable=not progress, leave=False):
        try:
            runs.append(read_local_run(d))
        except (BrokenRunError, CorruptLogError, ValueError) as err:
            where = "" if isinstance(err, BrokenRunError) else f"{d}: "  # a BrokenRunError names its folder
            warnings.warn(f"skipping {where}{err}", RuntimeWarning, stacklevel=2)
    return warn_provenance(drop_duplicate_seeds([r for r in runs if r.rows]))


NOT_SCIENCE = IGNORED - {"seed", "model.seed", "warmstart.seed"}
"""Fields two copies of one run may differ in (where it ran, how it logged)."""


def drop_duplicate_seeds(runs: list[Run]) -> list[Run]:
    """`runs` less any whose config (seeds included, NOT_SCIENCE and logging left out) equals an earlier
    one's: a copied or re-run folder is one seed, not two (which would also shrink its CI to ± 0). Each
    dropped run is named in a warning."""
    kept, seen = [], {}
    for run in runs:
        key = tuple(sorted((k, repr(_hashable(v))) for k, v in run.flat.items()
                           if k not in NOT_SCIENCE and not k.startswith(IGNORED_PREFIXES)))
        if key in seen:
            warnings.warn(
                f"skipping {run.source}: the same config and seed {run.seed} as {seen[key]}; one seed counts once",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        seen[key] = run.source
        kept.append(run)
    return kept


# --- W&B -------------------------------------------------------------------------------------------


def run_from_wandb(wb_run: Any) -> Run:
    """A `wandb.apis.public.Run` (anything with .config, .scan_history() and .path) as a Run.

    The trainer logs `dataclasses.asdict(cfg)` as the W&B config and each metrics row at step=step,
    so the config and rows come back as local runs have them ("_step" becomes "step").
    """
    config = unflatten({k: v for k, v in dict(wb_run.config).items() if not k.startswith("_")})
    origin = config.pop("provenance", None)
    rows = []
    for raw in wb_run.scan_history():
        row = {k: _to_float(v) for k, v in raw.items() if not k.startswith("_") and v is not None}
        row["step"] = int(raw.get("step", raw["_step"]))
        rows.append(row)
    rows.sort(key=lambda r: r["step"])
    path = "/".join(wb_run.path) if isinstance(wb_run.path, list | tuple) else str(wb_run.path)
    return Run(config=config, rows=rows, events=None, source=f"wandb:{path}", provenance=origin)


def load_wandb(path: str, group: str | None, progress: bool = True) -> list[Run]:
    """Runs of W&B project `path` ("entity/project"), optionally only those of `group`."""
    import wandb  # only needed for this source

    api = wandb.Api()
    wb_runs = list(api.runs(path, filters={"group": group} if group else None))
    runs = [
        run_from_wandb(r) for r in tqdm(wb_runs, desc="loading W&B runs", disable=not progress, leave=False)
    ]
    return warn_provenance(drop_duplicate_seeds([r for r in runs if r.rows]))


def warn_provenance(runs: list[Run]) -> list[Run]:
    """`runs`, after one warning if their provenance differs (moe_rl.provenance.provenance_mismatch)."""
    if mismatch := provenance_mismatch([r.provenance for r in runs]):
        warnings.warn(mismatch, RuntimeWarning, stacklevel=3)
    return runs


# --- grouping --------------------------------------------------------------------------------------


def _hashable(value: Any) -> Any:
    # An empty list is how a list option says "off", as a field the run's code predates does (None).
    if isinstance(value, list):
        return tuple(value) if value else None
    return value


def varying_fields(runs: list[Run]) -> list[str]:
    """Config fields with more than one value among runs sharing a base label (IGNORED excluded)."""
    by_base: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_base[run.base_label].append(run.flat)
    varying: set[str] = set()
    for flats in by_base.values():
        for key in set().union(*flats):
            if not splits_groups(key) or key in CLUSTER_FIELDS:
                continue
            if len({_hashable(f.get(key)) for f in flats}) > 1:
                varying.add(key)
    return sorted(varying)


def short_names(fields: list[str]) -> dict[str, str]:
    """Each field by its last component ("lr"), or in full where two fields share it."""
    last = [f.rsplit(".", 1)[-1] for f in fields]
    return {f: (s if last.count(s) == 1 else f) for f, s in zip(fields, last, strict=True)}


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def sort_key(value: Any) -> tuple:
    """Numbers before strings, numbers by value: lr 1e-05 sorts before 0.0001."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def group_label(run: Run, fields: list[str]) -> str:
    """Base label plus the run's value of each varying field: "grpo (replay=off) lr=0.0001"."""
    flat, names = run.flat, short_names(fields)
    extra = " ".join(f"{names[f]}={_fmt(flat.get(f))}" for f in fields)
    return f"{run.base_label} {extra}".strip()


def group_runs(runs: list[Run], fields: list[str] | None = None) -> dict[str, list[Run]]:
    """Runs by group label (base label + varying fields), each list sorted by seed; groups in a stable order."""
    fields = varying_fields(runs) if fields is None else fields
    groups: dict[str, list[Run]] = defaultdict(list)
    order: dict[str, tuple] = {}
    for run in runs:
        label = group_label(run, fields)
        groups[label].append(run)
        flat = run.flat
        order[label] = (run.base_label, *(sort_key(flat.get(f)) for f in fields))
    return {label: sorted(groups[label], key=lambda r: r.seed) for label in sorted(groups, key=order.get)}
