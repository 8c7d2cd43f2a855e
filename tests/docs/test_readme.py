"""The README is a front door a newcomer reads in five minutes (issue 36's acceptance).

Its Quick start is ``examples/quickstart.py``, byte for byte, which
``tests/e2e/test_loop_exits.py`` runs twice under ``phalanx run``.
"""

from __future__ import annotations

import re

from phalanx.precisions import PRECISIONS
from tests.docs.snippets import ROOT, Block, parse

README = ROOT / "README.md"
QUICK_START = ROOT / "examples" / "quickstart.py"
MAX_LINES = 220
MAX_LINE = 300  # characters, outside code blocks
MAX_CELL = 200  # characters of a table cell


def text() -> str:
    return README.read_text(encoding="utf-8")


def prose() -> list[tuple[int, str]]:
    """(line number, line) of every README line outside the fenced code blocks."""
    lines = text().splitlines()
    fenced = {n for b in parse(text(), README) for n in range(b.line, b.end + 1)}
    return [(n, line) for n, line in enumerate(lines, 1) if n not in fenced]


def quick_start() -> Block:
    """The first python block after the ``## Quick start`` heading."""
    lines = text().splitlines()
    heading = lines.index("## Quick start") + 1
    return next(b for b in parse(text(), README) if b.lang == "python" and b.line > heading)


def test_the_readme_is_at_most_220_lines() -> None:
    assert len(text().splitlines()) <= MAX_LINES


def test_no_line_outside_code_blocks_is_over_300_characters() -> None:
    long = [f"README.md:{n}: {len(line)} characters" for n, line in prose() if len(line) > MAX_LINE]
    assert not long, "\n".join(long)


def test_no_table_cell_is_over_200_characters() -> None:
    long = []
    for n, line in prose():
        if line.lstrip().startswith("|"):
            cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
            long += [f"README.md:{n}: {c.strip()[:60]}..." for c in cells if len(c) > MAX_CELL]
    assert not long, "\n".join(long)


def test_the_quick_start_is_examples_quickstart_py_byte_for_byte() -> None:
    block = quick_start()
    readme_lines = text().encode("utf-8").split(b"\n")
    shown = b"\n".join(readme_lines[block.line : block.end - 1]) + b"\n"
    assert shown == QUICK_START.read_bytes(), (
        "README.md's Quick start differs from examples/quickstart.py: copy the file into the "
        f"block at README.md:{block.line}"
    )


def test_the_quick_start_speaks_the_one_vocabulary() -> None:
    """One precision spelling (no old alias) and one ``job.step()`` form."""
    code = QUICK_START.read_text()
    precisions = re.findall(r"precision=\"([^\"]+)\"", code)
    assert precisions and set(precisions) <= set(PRECISIONS), precisions
    assert re.findall(r"job\.step\((.*?)\)", code) == [""]


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub and MkDocs' toc make it for plain headings."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_readmes_links_resolve() -> None:
    """Every relative link names a file of the repository, and an anchor one of its headings."""
    broken = []
    for n, line in prose():
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = ROOT / path
            if not file.is_file():
                broken.append(f"README.md:{n}: {target}: no such file")
            elif anchor:
                headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.M)
                if anchor not in {slug(h) for h in headings}:
                    broken.append(f"README.md:{n}: {target}: no heading with that anchor")
    assert not broken, "\n".join(broken)
