"""The committed reports under docs/results/: small enough to keep in git, every link in them resolves, and
the per-run tables beside them are small and give their report's numbers alone."""

import re
from pathlib import Path

import pytest

from analysis.report import write_report
from analysis.runtable import FILE, bytes_per_run, read_table

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"
TOTAL = 20_000_000
"""docs/results/ in all, in bytes (issue 54): a constant that no commit raises. A sweep's raw records go to
the record store (moe_rl/records.py), and a new report makes room within it. It held 17.99 MB when set."""
LIMIT = 1_000_000
OVER_LIMIT = {
    "critical_lr": 1_210_000,
    "critical_lr_redo": 1_520_000,  # 240 runs: table.json keeps every run's values
    "natural_balanced": 1_380_000,
    "noise_dose": 1_060_000,
    "replay_offpolicy": 2_090_000,
    "router_lr_own_lr": 1_440_000,  # 384 runs: table.json keeps every run's values
}
"""Reports still over LIMIT, each with a ceiling in bytes (the list can only shrink, the ceilings only fall).
Their raw runs are not committed, so they cannot be regenerated with the current writer (compact PNGs, one
faceted length figure above 8 groups); their PNGs were re-encoded as the writer saves them (a 64-colour
palette, then oxipng), which is as far as they shrink without dropping a figure."""
RAW = ("*.tar.xz", "*.tar", "*.tgz", "metrics.jsonl", "events.jsonl", "summary.json", "*.safetensors")
"""What a run folder or a sittings archive holds: records, which belong in the record store."""
LINK = re.compile(r"\]\(([^)\s]+)\)")
PER_RUN = 10_000
"""A per-run table's bytes per run (issue 54: well under 1 MB per 100 runs); a constant, like TOTAL."""
PAIRS = {
    "confirm_sort_long": (("gspo (replay=off) lr=0.0002", "grpo (replay=off) lr=0.0001"),
                          ("gspo (replay=off) lr=0.0002", "grpo_rr (replay=old) lr=0.0001")),
}
"""The `--pair`s of each study's moe-rl-analyze line (experiments/NAME.sh)."""
TABLES = sorted(RESULTS.rglob(FILE))


def _folders() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.is_dir())


def _bytes(folder: Path) -> int:
    """The report's bytes: its per-run table has its own limit (PER_RUN), and counts in TOTAL."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.name != FILE)


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: p.name)
def test_each_committed_report_is_under_a_megabyte(folder):
    """Every docs/results/* folder holds under 1 MB, except the listed ones, which may not grow past their ceiling."""
    assert _bytes(folder) < OVER_LIMIT.get(folder.name, LIMIT), f"{folder.name}: {_bytes(folder)} bytes"


def test_the_over_limit_list_only_names_reports_still_over_the_limit():
    """A report taken under 1 MB leaves OVER_LIMIT (the list can only shrink)."""
    sizes = {p.name: _bytes(p) for p in _folders()}
    assert {name for name in OVER_LIMIT if sizes.get(name, 0) >= LIMIT} == set(OVER_LIMIT)


def test_docs_results_stays_under_its_constant_ceiling():
    """docs/results/ holds at most TOTAL bytes, whatever a commit adds."""
    total = sum(f.stat().st_size for f in RESULTS.rglob("*") if f.is_file())
    assert total <= TOTAL, f"docs/results holds {total} bytes, over {TOTAL}: make room, do not raise the ceiling"


def test_no_raw_run_records_are_committed_under_docs_results():
    """Archives and run folders' files stay out of the tree: a study commits its records.json manifest."""
    found = sorted(str(f.relative_to(RESULTS)) for pattern in RAW for f in RESULTS.rglob(pattern))
    assert not found, f"raw records under docs/results (publish them: moe-rl-archive publish): {found[:5]}"


def test_every_relative_link_in_the_committed_reports_resolves():
    """Each markdown link or image in docs/results/**/*.md that is not a URL or an anchor names a file that exists."""
    broken = []
    for md in sorted(RESULTS.rglob("*.md")):
        for target in LINK.findall(md.read_text()):
            if re.match(r"^[a-z]+://|^#|^mailto:", target):
                continue
            if not (md.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{md.relative_to(RESULTS)}: {target}")
    assert not broken, "\n".join(broken)


def test_the_studies_with_fetchable_records_keep_a_per_run_table():
    """Every study whose records.json lists archives keeps runs.parquet beside its report (stale_rivals has
    no report yet: its step-size stage wrote step_size.json)."""
    with_report = {m.parent.name for m in RESULTS.glob("*/records.json") if (m.parent / "report.md").exists()}
    assert with_report == {t.parent.name for t in TABLES} == {"confirm_sort_long", "router_lr_own_lr"}


@pytest.mark.parametrize("table", TABLES, ids=lambda p: p.parent.name)
def test_each_per_run_table_is_small_and_gives_its_reports_numbers_alone(table, tmp_path):
    """Under PER_RUN bytes per run, and the analysis from the table alone writes the committed table.json,
    byte for byte."""
    assert bytes_per_run(table) < PER_RUN, f"{table}: {bytes_per_run(table):.0f} bytes per run"
    write_report(read_table(table), tmp_path, "t", ["t"], pairs=PAIRS.get(table.parent.name, ()))
    assert (tmp_path / "table.json").read_bytes() == (table.parent / "table.json").read_bytes()
