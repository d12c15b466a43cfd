"""A report section as a plug-in: what analysis.report.write_report loops over.

A `Section` says when it applies to a sweep, computes its result once, and turns that result into the
report's text, its tables file, its table.json entries and its figures. write_report walks the
registry (analysis.report.SECTIONS) in order, which is the order of report.md's sections and of
table.json's keys; a module that adds a kind of analysis adds one Section there and touches nothing
else. A section's module keeps its statistics; the Section only wires them.

Figures: the sweep's curves (analysis.figures) come first in report.md's figure list, preceded by the
figures of `lead` sections (the headline plot of a sweep built for that section: the phase diagram,
the off-policy contrasts) and followed by every other section's figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.load import Run

Figures = dict[str, tuple[Path, str]]
"""{figure name: (PNG path, caption)}, in the order report.md lists them."""


@dataclass(frozen=True)
class Sweep:
    """What every section reads: the runs, the config fields that vary between them, the groups those
    fields split the runs into (analysis.load.group_runs), and the report's settings: among them `pairs`,
    named pairs of groups compared although a varying field differs (each objective at its own lr)."""

    runs: list[Run]
    fields: list[str]
    groups: dict[str, list[Run]]
    permutations: int = 10_000
    smooth: float = 0.0
    pairs: tuple[tuple[str, str], ...] = ()  # groups to compare across settings too (`--pair`)


def always(sweep: Sweep) -> bool:
    """The `applies` of a section every report has."""
    return True


def no_figures(result: Any, out_dir: Path) -> Figures:
    """The `figures` of a section that draws none."""
    return {}


@dataclass(frozen=True)
class Section:
    """One section of report.md, with its files.

    name: the section's id and, unless `json` says otherwise, its key in table.json.
    heading: the `## heading` in report.md.
    compute(sweep): the result, computed once; None when there is nothing to report after all (the
        section is then left out everywhere, as when `applies` is false).
    markdown(result): the section's tables, as `file` holds them and report.md shows them.
    file: the markdown file under the report folder that holds `markdown(result)` when report.md does not
        show it (a `body` that differs); None for none. A file would only repeat report.md's text.
    intro: the paragraph report.md prints between the heading and the tables ("" for none).
    applies(sweep): whether the sweep has what the section needs (cheap; before compute).
    json(result): the section's entries of table.json; None: {name: result}.
    figures(result, out_dir): the PNGs it draws under out_dir, {name: (path, caption)}.
    lead: its figures come before the curves in report.md's figure list.
    body(result): report.md's text under the heading when it differs from `markdown(result)` (None:
        the same); "" leaves the section out of report.md (its file and table.json entries stay).
    steps: it reads per-step curves (`Run.series` of a per-step key), which a per-run table does not
        keep: a report made from one (analysis.runtable) leaves it out and says so. Every other section
        reads per-run quantities and eval rows only, and gives the same result from the table.
    """

    name: str
    heading: str
    compute: Callable[[Sweep], Any]
    markdown: Callable[[Any], str]
    file: str | None = None
    intro: str = ""
    applies: Callable[[Sweep], bool] = always
    json: Callable[[Any], dict[str, Any]] | None = None
    figures: Callable[[Any, Path], Figures] = no_figures
    lead: bool = False
    body: Callable[[Any], str] | None = None
    steps: bool = False

    def entries(self, result: Any) -> dict[str, Any]:
        """table.json's entries for `result`."""
        return {self.name: result} if self.json is None else self.json(result)

    def report_text(self, result: Any) -> str:
        """The section as report.md prints it: heading, intro, tables; "" when its body is empty."""
        body = self.markdown(result) if self.body is None else self.body(result)
        if not body:
            return ""
        return "\n\n".join(part for part in (f"## {self.heading}", self.intro, body) if part)


def doc_intro(doc: str | None) -> str:
    """A module docstring less its first paragraph: the intro its section prints under the heading."""
    return (doc or "").split("\n\n", 1)[1].strip()
