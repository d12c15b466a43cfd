"""`moe-rl-train` (= `python -m moe_rl.train`): RL of a small MoE with GRPO, GRPO + routing replay or GSPO.

    moe-rl-train                                         # GSPO on the tiny Qwen3-MoE, arithmetic task
    moe-rl-train objective=grpo_rr trainer.steps=100     # GRPO with Routing Replay of the old policy
    moe-rl-train -m objective=grpo,grpo_rr,gspo seed=0,1 # a sweep; prints a comparison table at the end
    moe-rl-train resume=true hydra.run.dir=outputs/...   # continue a run from its last checkpoint

Config groups live in `conf/`; the typed schema is `moe_rl.config.Config`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
import typing
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moe_rl.config import Config
from moe_rl.errors import RunError, one_line, one_line_warnings
from moe_rl.startup import check_config, check_machine, load_task

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

ConfigStore.instance().store(name="schema", node=Config)
if not OmegaConf.has_resolver("pid"):  # ${pid:} in conf/config.yaml's run and sweep folders
    OmegaConf.register_new_resolver("pid", os.getpid)


def unknown_keys(cfg: DictConfig, schema: type, prefix: str = "") -> list[str]:
    """Keys of `cfg` that `schema` (a dataclass, at any depth) has no field for. Hydra lets `+key=value`
    add them, and `OmegaConf.to_object` would carry them along unused: a typo that silently does nothing."""
    hints = typing.get_type_hints(schema)
    unknown = []
    for key in cfg:
        if key not in hints:
            unknown.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(hints[key]) and isinstance(cfg[key], DictConfig):
            unknown += unknown_keys(cfg[key], hints[key], f"{prefix}{key}.")
    return unknown


def to_config(cfg: DictConfig) -> Config:
    """Convert the composed config to the typed `Config` once, and check it (`moe_rl.startup.check_config`:
    the schema's validation, then a model.pretrained folder's files); ValueError names the field."""
    if unknown := unknown_keys(cfg, Config):
        raise ValueError(
            f"{unknown[0]}: no such field in the schema (moe_rl/config.py); check the spelling"
            + (f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else "")
        )
    try:
        config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ValueError(
            f"{getattr(err, 'full_key', '')}: {err.msg if hasattr(err, 'msg') else err}"
        ) from err
    check_config(config)
    return config


def hydra_record(cfg: DictConfig) -> dict[str, str]:
    """The job's `.hydra/` files as Hydra's run_job would write them (config.yaml, hydra.yaml, overrides.yaml).

    conf/config.yaml sets hydra.output_subdir=null, so Hydra writes none of them before the job starts;
    moe_rl.trainer.run.train writes these once the run folder is locked and the run accepted, so that a
    refused run (a locked folder, a refused resume) leaves the folder's record as it was.
    """
    hc = HydraConfig.get()
    return {
        "config.yaml": OmegaConf.to_yaml(cfg),
        "hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": hc})),
        "overrides.yaml": OmegaConf.to_yaml(hc.overrides.task),
    }


def record_failure(run_dir: Path, err: BaseException, record: dict[str, str]) -> None:
    """Leave failed.json (the error and its traceback) in a failed sweep job's folder, and the job's
    `.hydra/` record where the folder has none (the end-of-sweep callback counts jobs by it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    failure = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exception(err)}
    (run_dir / "failed.json").write_text(json.dumps(failure, indent=2))
    if not (run_dir / ".hydra").exists():
        (run_dir / ".hydra").mkdir()
        for name, text in record.items():
            (run_dir / ".hydra" / name).write_text(text)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Validate, then train; returns the final mean reward (Hydra sweepers can optimise it).

    In a sweep a failing job records failed.json and returns NaN: the launcher runs the other jobs, and
    the end-of-sweep callback (analysis.compare.ComparisonTableCallback) prints the table of those
    that finished, names the failed ones and exits 1. (A raise would make Hydra print a traceback and
    skip the callback; sys.exit would end the whole sweep at once.)
    """
    one_line_warnings("moe-rl-train")
    hc = HydraConfig.get()
    sweeping = hc.mode.name == "MULTIRUN"
    run_dir = Path(hc.runtime.output_dir)
    record = hydra_record(cfg)
    try:
        config = to_config(cfg)
        check_machine(config)
        task = load_task(config)  # a dataset's file, fields, verifier and reward function, before anything runs
    except ValueError as err:
        print(f"moe-rl-train: invalid config: {err}", file=sys.stderr)
        if not sweeping:
            sys.exit(2)
        record_failure(run_dir, err, record)
        return float("nan")
    except RunError as err:  # user code interrupted at start-up (a reward function's KeyboardInterrupt)
        print(f"moe-rl-train: {err}", file=sys.stderr)
        if not sweeping:
            sys.exit(1)
        record_failure(run_dir, err, record)
        return float("nan")
    from moe_rl.trainer.folder import FolderInUseError
    from moe_rl.trainer.run import train  # heavy imports only after the config is known to be good

    group = Path(hc.sweep.dir).name if sweeping else None
    try:
        summary = train(config, run_dir, wandb_group=group, hydra_record=record, task=task)  # built once
    except Exception as err:
        message = one_line(err)  # a corrupt checkpoint, a refused resume, a full disk: no traceback
        if sweeping and isinstance(err, FolderInUseError):  # another live run's folder: touch nothing there
            print(f"moe-rl-train: {message}", file=sys.stderr)
            return float("nan")
        if sweeping:
            record_failure(run_dir, err, record)
            if message is None:
                traceback.print_exception(err)  # a bug: its traceback, but the sweep goes on
            else:
                print(f"moe-rl-train: {message}", file=sys.stderr)
            return float("nan")
        if message is None:
            raise
        print(f"moe-rl-train: {message}", file=sys.stderr)
        sys.exit(1)
    return summary["final"].get("rollout/reward/mean", float("nan"))


def run_dir_problem(argv: list[str]) -> str | None:
    """Why a `hydra.run.dir=` / `hydra.sweep.dir=` override cannot be a run folder (it, or a folder above
    it, is a file), or None. Checked before Hydra, which would otherwise fail creating it with a traceback."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in ("hydra.run.dir", "hydra.sweep.dir") or not value:
            continue
        path = Path(value).expanduser()
        for here in (path, *path.parents):
            if here.exists() and not here.is_dir():
                return f"{key}={value}: {here} is a file, not a folder; give the run a folder ({key}=...)"
    return None


def cli() -> None:
    """The `moe-rl-train` command: `main`, after the checks Hydra's own start-up would fail on unreadably."""
    one_line_warnings("moe-rl-train")
    problem = run_dir_problem(sys.argv[1:])
    if problem:
        print(f"moe-rl-train: invalid config: {problem}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
