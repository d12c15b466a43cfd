"""`moe-rl-analyze`: figures, tables and a report page for a sweep, from local folders or W&B.

    moe-rl-analyze multirun/default/2026-01-01_12-00-00 [more sweep folders ...] --out report/
    moe-rl-analyze docs/results/confirm_sort_long/runs.parquet --out report/   # a per-run table alone
    moe-rl-analyze --wandb ENTITY/PROJECT --group GROUP --out report/ --title "GSPO vs GRPO"

    moe-rl-analyze multirun/stability --out report/ --smooth 0.6 --permutations 20000
    moe-rl-analyze multirun/sweep --out report/ --pair "gspo (replay=off) lr=0.0002" "grpo (replay=off) lr=0.0001"

Writes OUT/report.md (open it in any markdown viewer; it holds every table), OUT/*.png, OUT/table.json,
OUT/runs.parquet (the per-run table, analysis.runtable: the analysis runs from it alone, save the per-step
curves) and OUT/collapse_table.md (the collapse table in full). Tables give mean ± 95% CI over seeds
(Student t); pairs of objectives get paired or Welch t and permutation tests, and, for runs with
`eval/expected_accuracy`, the paired AUC difference and a log-rank test of time to regression
(analysis.pairs, analysis.outcomes). table.json keeps every seed's values. Without a tty
(or with --no-progress) no progress bar.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis.load import load_local, load_wandb
from analysis.recount import recount
from analysis.report import write_report
from analysis.runtable import read_table
from moe_rl.errors import one_line_warnings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="moe-rl-analyze",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument("sweep_dirs", nargs="*", type=Path,
                        help="sweep or run folders, searched recursively, or per-run tables (*.parquet)")
    parser.add_argument(
        "--wandb", metavar="ENTITY/PROJECT", help="read runs from W&B instead of local folders"
    )
    parser.add_argument("--group", help="W&B group (with --wandb); all runs of the project when omitted")
    parser.add_argument(
        "--out", type=Path, required=True, help="output folder for report.md, figures, tables"
    )
    parser.add_argument("--title", default=None, help="report title (default: names the sources)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while loading")
    parser.add_argument(
        "--smooth",
        type=float,
        default=0.0,
        metavar="W",
        help="EMA weight in [0, 1) for the curves, s_t = W s_(t-1) + (1 - W) x_t per seed, raw mean drawn "
        "faint behind (default 0: no smoothing)",
    )
    parser.add_argument(
        "--permutations",
        type=int,
        default=10_000,
        metavar="N",
        help="collapse-rate permutation test: exact when the seed splits number at most N, else N random "
        "splits seeded with 0 (default 10000)",
    )
    parser.add_argument(
        "--pair",
        nargs=2,
        action="append",
        default=[],
        metavar=("A", "B"),
        help="also compare group A with group B (labels as the summary table prints them) although a swept "
        "field differs, e.g. each objective at its own lr; repeatable",
    )
    parser.add_argument(
        "--recount",
        action="store_true",
        help="re-count reward_collapse and eval_regression events with the current detector from the logged "
        "metrics before any table (analysis.recount; for runs logged before it)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.smooth < 1:
        parser.error(f"--smooth must be in [0, 1), got {args.smooth}")
    if args.permutations < 1:
        parser.error(f"--permutations must be at least 1, got {args.permutations}")
    if bool(args.sweep_dirs) == bool(args.wandb):
        parser.error("give either SWEEP_DIR ... or --wandb ENTITY/PROJECT, not both and not neither")
    if args.group and not args.wandb:
        parser.error("--group needs --wandb")
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point of `moe-rl-analyze`."""
    args = parse_args(argv)
    one_line_warnings("moe-rl-analyze")
    progress = not args.no_progress and sys.stderr.isatty()
    tables = [d for d in args.sweep_dirs if d.suffix == ".parquet"]
    if args.wandb:
        runs = load_wandb(args.wandb, args.group, progress=progress)
        sources = [f"wandb:{args.wandb}" + (f" group={args.group}" if args.group else "")]
    else:
        folders = [d for d in args.sweep_dirs if d.suffix != ".parquet"]
        missing = [str(d) for d in folders if not d.is_dir()] + [str(t) for t in tables if not t.is_file()]
        if missing:
            raise SystemExit(f"moe-rl-analyze: {', '.join(missing)}: no such folder or table")
        runs = (load_local(folders, progress=progress) if folders else []) + [r for t in tables for r in read_table(t)]
        sources = [str(d) for d in args.sweep_dirs]
    if not runs:
        raise SystemExit(f"no runs with metrics found in {', '.join(sources)}")
    if args.recount and tables:
        raise SystemExit("moe-rl-analyze: --recount reads every step's metrics, which a per-run table does not keep")
    if args.recount:
        runs = [recount(run) for run in runs]
        sources = [*sources, "collapse events re-counted with the current detector (analysis.recount)"]
    title = args.title or f"moe-rl sweep: {', '.join(sources)}"
    try:
        report = write_report(runs, args.out, title, sources, smooth=args.smooth, permutations=args.permutations,
                              pairs=tuple(map(tuple, args.pair)))
    except ValueError as error:
        if not str(error).startswith("--pair"):
            raise
        raise SystemExit(f"moe-rl-analyze: {error}") from None
    print(f"{len(runs)} runs -> {report}")


if __name__ == "__main__":
    main()
