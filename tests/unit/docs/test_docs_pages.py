"""The README is a front door and the docs pages hold the rest: links resolve, the README stays short, quotes
no timings, gives the test command CI runs and the golden quickstart numbers.

Anchors follow GitHub's rule for heading ids: the heading's rendered text, lower-cased, with every character
that is not a letter, digit, underscore, hyphen or space dropped, spaces turned into hyphens, and -1, -2, ...
appended to repeats.
"""

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
README = REPO / "README.md"
README_MAX_LINES = 250
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
FRONT_DOOR_PAGES = [
    "training", "objectives", "replay", "analysis", "scaling", "performance", "reliability", "results"]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
# A measured duration: a number, then a unit of time (2 min, 10 s, 0.83 s, 45 minutes, 1.5h, 110 core-min).
TIMING = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?\s?(?:core-)?(?:ms|s|secs?|seconds?|min|mins|minutes?|h|hrs?|hours?)\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[str]]:
    """(line number, line) for every line outside fenced code blocks, and the lines inside them."""
    prose, code, fenced = [], [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif fenced:
            code.append(line)
        else:
            prose.append((number, line))
    return prose, code


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    return split_fences(text)[0]


def slug(heading: str) -> str:
    """GitHub's id for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading renders as its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading id of a markdown file, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Each relative link or #anchor of `path` that names no existing file or heading, as 'file:line: target'."""
    bad = []
    for number, line in prose_lines(path.read_text()):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}:{number}: {target}"
            if not dest.exists():
                bad.append(where + " (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                bad.append(where + " (no such heading)")
    return bad


def timings(text: str) -> list[str]:
    """Every time figure in prose (fenced code blocks left out)."""
    return [f"{n}: {m.group(0)}" for n, line in prose_lines(text) for m in TIMING.finditer(line)]


def test_every_relative_link_and_anchor_resolves():
    """Every relative link and #anchor in README.md and docs/*.md names an existing file and, for markdown, an existing heading."""
    assert [b for page in PAGES for b in broken_links(page)] == []


def test_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path):
    """The link check reports a link to a missing file and an anchor no heading has, and passes good ones and code."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page: with `code`\n\n## W&B\n\n## W&B\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[ok](docs/page.md#a-page-with-code) [ok](docs/page.md#wb-1) [ok](#top) [web](https://x.org/y)\n"
        "[gone](docs/missing.md) [bad](docs/page.md#nowhere)\n"
        "`[not a link](nowhere.md)`\n```\n[in code](nowhere.md)\n```\n# Top\n")
    assert [b.split(": ", 1)[1] for b in broken_links(readme)] == [
        "docs/missing.md (no such file)", "docs/page.md#nowhere (no such heading)"]


def test_readme_is_short():
    """README.md holds at most 250 lines."""
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def repeated_headings(text: str) -> list[str]:
    """Section headings (## and below) that appear twice on one page: a move that left a section behind."""
    seen, out = set(), []
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if m and len(m.group(1)) == 2:
            out += [m.group(2)] if m.group(2) in seen else []
            seen.add(m.group(2))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_section_heading_repeats(page):
    """No ## heading appears twice on a page (and the check finds one on a synthetic page)."""
    assert repeated_headings("## A\n## B\n```\n## A\n```\n## A\n") == ["A"]
    assert repeated_headings(page.read_text()) == []


def test_readme_links_every_docs_page():
    """README.md links each docs page a reader goes to next (training, objectives, replay, analysis, ...)."""
    linked = {t.partition("#")[0] for _, line in prose_lines(README.read_text()) for t in LINK.findall(line)}
    assert [p for p in FRONT_DOOR_PAGES if f"docs/{p}.md" not in linked] == []


def readme_test_command(text: str) -> str:
    """The pytest command of the README's one code line that runs the tests."""
    runs = [line[line.index("python -m pytest") :].split("  #")[0].strip()
            for line in split_fences(text)[1] if "python -m pytest" in line]
    assert len(runs) == 1, runs
    return runs[0]


def test_ci_runs_the_readme_test_command_verbatim():
    """.ci/run has a line that is exactly the README's test command."""
    command = readme_test_command(README.read_text())
    assert command in [line.strip() for line in (REPO / ".ci/run").read_text().splitlines()], command


def test_readme_quotes_no_timing_figures():
    """README.md's prose states no measured duration: timings live, dated, on the docs page that measured them."""
    assert timings(README.read_text()) == []


@pytest.mark.parametrize("text", ["took 2 min", "(10 s)", "in 0.83 s.", "45 minutes", "1.5h", "110 core-min",
                                  "69 ms"])
def test_timing_check_finds_a_duration(text):
    """A duration in prose is found."""
    assert len(timings(text)) == 1


@pytest.mark.parametrize("text", ["150 steps", "6 seeds, 1105 tests", "top-2 of 8 experts", "1e-9 relative",
                                  "σ = 0.8, ~10%", "```bash\nsleep 10 s\n```"])
def test_timing_check_leaves_other_numbers_alone(text):
    """Counts, settings and code blocks are not timings."""
    assert timings(text) == []


def test_wall_clock_times_are_dated():
    """Every entry of docs/performance.md's wall-clock section carries the date it was measured."""
    text = (REPO / "docs/performance.md").read_text()
    section = text[text.index("## Wall-clock times"):].split("\n## ")[0]
    entries = re.findall(r"^- \*\*.*?(?=^- \*\*|\Z)", section, flags=re.M | re.S)
    assert entries and [e[:40] for e in entries if not DATE.search(e)] == []
    rows = [line for line in section.splitlines() if line.strip().startswith("| `")]
    assert rows and [r for r in rows if not DATE.search(r)] == []


def test_readme_quickstart_numbers_equal_the_golden_file():
    """The quickstart command, warm start, quoted accuracies and table in README.md equal docs/golden/quickstart.json."""
    golden = json.loads((REPO / "docs/golden/quickstart.json").read_text())
    readme = README.read_text()
    assert golden["command"] in readme
    labels = ["grpo (replay=off)", "grpo_rr (replay=old)", "gspo (replay=off)"]
    table = golden["table"]
    num = r"(\d+(?:\.\d+)?)"
    m = re.search(rf"final\s+expected accuracy {num}, {num}, {num} and held-out accuracy {num}, {num}, {num}"
                  r" for GRPO, GRPO \+ RR, GSPO", readme)
    assert m, "the README's sentence quoting the golden accuracies"
    quoted = [float(x) for x in m.groups()]
    expected = [round(table[k]["final expected acc"], 3) for k in labels] + [
        round(table[k]["final eval acc"], 3) for k in labels]
    assert quoted == pytest.approx(expected, abs=6e-4)
    ws = re.search(rf"stops after (\d+) steps\s+at held-out accuracy {num}", readme)
    assert ws and int(ws.group(1)) == golden["warmstart"]["steps"]
    assert float(ws.group(2)) == pytest.approx(golden["warmstart"]["accuracy"], abs=6e-4)
    header = next(line for line in readme.splitlines() if line.startswith("| run | "))
    columns = [c.strip() for c in header.strip("|").split("|")][1:]
    for label in labels:
        row = next((line for line in readme.splitlines() if line.startswith(f"| {label} |")), None)
        assert row, label
        cells = [float(c) for c in row.strip("|").split("|")[1:]]
        assert cells == pytest.approx([table[label][c] for c in columns], abs=6e-4), label
