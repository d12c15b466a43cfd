"""Read one section of a report.md that moe-rl-analyze wrote (its tables are there, not in files of their own)."""

from pathlib import Path


def section(report: Path | str, heading: str) -> str:
    """The text under `## heading` in report.md (the path, or its text), up to the next `## ` heading."""
    text = Path(report).read_text() if isinstance(report, Path) else report
    start = text.index(f"## {heading}\n") + len(heading) + 4
    end = text.find("\n## ", start)
    return text[start:] if end < 0 else text[start:end]


def first_table(text: str) -> str:
    """The first markdown table (its consecutive `|` lines) in `text`."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rest = next((i for i, line in enumerate(lines[first:], first) if not line.startswith("|")), len(lines))
    return "\n".join(lines[first:rest])
