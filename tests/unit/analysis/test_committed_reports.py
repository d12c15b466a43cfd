"""The committed reports under docs/results/: small enough to keep in git, and every link in them resolves."""

import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"
LIMIT = 1_000_000
OVER_LIMIT = {
    "confirm_sort_long": 9_500_000,  # the pre-registered sweep's run records, kept between sittings (moe-rl-archive):
    # about 1.5 MB per warm start of 16 runs, 6 warm starts, and its report (9.44 MB in all)
    "critical_lr": 1_900_000,
    "critical_lr_redo": 2_450_000,  # 240 runs: table.json keeps every run's values
    "natural_balanced": 1_950_000,
    "noise_dose": 1_750_000,
    "replay_offpolicy": 3_200_000,
    "router_lr_own_lr": 41_000_000,  # the pre-registered sweep's run records, kept between sittings: about
    # 9.6 MB per warm start of 96 runs (each run's metrics.jsonl keeps every step), 4 warm starts (38.3 MB),
    # and its report of 384 runs (2.4 MB; table.json keeps every run's values): 40.67 MB in all
    "replay_staleness": 1_350_000,  # 120 runs: table.json keeps every run's values
    "stale_rivals": 2_400_000,  # the pre-registered study's step-size stage: 96 runs' records (2.17 MB), kept
    # between sittings, and its calibration and expert-change figure (0.16 MB): 2.33 MB. Its test stages'
    # records wait for a record store outside the tree (issue 54), not for a higher ceiling here
    "safety_nets": 1_450_000,
}
"""Reports still over LIMIT, each with a ceiling in bytes. Their raw runs are not committed, so they cannot
be regenerated with the current writer (compact PNGs, one faceted length figure above 8 groups); their PNGs
were re-encoded as palette PNGs, which is as far as they shrink without dropping a figure. Regenerating one
from its runs takes it off this list. Three are over it by what they hold, each said on its line: confirm_sort_long
and router_lr_own_lr keep the runs themselves, and critical_lr_redo's table has 240 runs."""
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _folders() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.is_dir())


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: p.name)
def test_each_committed_report_is_under_a_megabyte(folder):
    """Every docs/results/* folder holds under 1 MB, except the listed ones, which may not grow past their ceiling."""
    assert _bytes(folder) < OVER_LIMIT.get(folder.name, LIMIT), f"{folder.name}: {_bytes(folder)} bytes"


def test_the_over_limit_list_only_names_reports_still_over_the_limit():
    """A report taken under 1 MB leaves OVER_LIMIT (the list can only shrink)."""
    sizes = {p.name: _bytes(p) for p in _folders()}
    assert {name for name in OVER_LIMIT if sizes.get(name, 0) >= LIMIT} == set(OVER_LIMIT)


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
