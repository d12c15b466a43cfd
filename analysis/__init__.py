"""Analysis of moe-rl sweeps: figures, tables and a report page in the style of the GSPO paper.

Run it as `moe-rl-analyze SWEEP_DIR [SWEEP_DIR ...] --out OUT_DIR` (local Hydra sweep folders) or
`moe-rl-analyze --wandb ENTITY/PROJECT --group GROUP --out OUT_DIR` (W&B public API), or from a
report's per-run table, `moe-rl-analyze OUT_DIR/runs.parquet --out ...` (analysis.runtable). Every source
produces the same in-memory list of `Run` records (analysis.load), from which analysis.report builds
the tables and analysis.figures the PNGs; sections read a run's per-run quantities (`Run.mean`, `total`,
`last`, `summary`) and its eval rows, and only those marked `steps` read per-step curves. Every aggregate over seeds carries a 95% confidence
interval (analysis.stats), and analysis.pairs tests differences between objectives.
"""


__all__ = ["Run", "group_runs", "load_local", "load_wandb", "varying_fields"]


def __getattr__(name: str):
    # Imported on first use, not with the package: `python -m analysis.compare` (moe-rl-compare) must not
    # find analysis.compare already imported through analysis.load when it starts.
    if name in __all__:
        from analysis import load

        return getattr(load, name)
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")
