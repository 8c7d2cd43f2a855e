"""The documentation site: ``mkdocs build --strict`` passes (zero warnings), every internal link
of the built site resolves, the API reference covers ``phalanx.__all__``, and the benchmark page
is what ``tools/bench_page.py`` makes from benchmarks/results/."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.script_module import load_script

ROOT = Path(__file__).resolve().parents[2]
INSTALL = "pip install -e '.[docs]'"
BUILD_DEADLINE_S = 240  # about 10 s on an idle 2-core box; the rest is headroom for load


def _tool(name: str) -> ModuleType:
    """A script under tools/ (not a package) as a module."""
    return load_script(ROOT / "tools" / f"{name}.py", f"_tools_{name}")


def _need_mkdocs() -> None:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: {INSTALL}")


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean"]
    return subprocess.run(
        [*command, "--config-file", str(config), "--site-dir", str(site)],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_DEADLINE_S,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this file with warnings as errors."""
    _need_mkdocs()
    out = tmp_path_factory.mktemp("site")
    proc = _mkdocs_build(ROOT / "mkdocs.yml", out)
    warnings = [line for line in proc.stderr.splitlines() if re.match(r"(WARNING|ERROR)\b", line)]
    assert proc.returncode == 0 and not warnings, (
        f"mkdocs build --strict failed (exit {proc.returncode}):\n"
        + ("\n".join(warnings) or proc.stderr[-4000:])
    )
    return out


def test_site_builds_with_zero_warnings(site: Path) -> None:
    for page in ("index.html", "reference/job/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page
    # the API reference is rendered from the docstrings, not left as `::: phalanx.Job`
    job = (site / "reference/job/index.html").read_text(encoding="utf-8")
    assert 'id="phalanx.Job"' in job and ":::" not in job
    # the hook turned the marker into `phalanx run --help`'s text, and dropped reST roles
    launcher = (site / "reference/launcher/index.html").read_text(encoding="utf-8")
    assert "usage: phalanx run" in launcher and "phalanx-help:" not in launcher
    assert ":func:<code>" not in job


def test_reference_renders_functions_and_classes_not_their_modules(site: Path) -> None:
    """griffe resolves ``phalanx.spawn`` to the module phalanx/launch/spawn.py, not the function
    it defines: each object a reference page documents at the top must be a class or function."""
    kinds = re.compile(
        r'<h2 id="([^"]+)" class="doc doc-heading">\s*<code class="doc-symbol '
        r'doc-symbol-heading doc-symbol-(\w+)"'
    )
    wrong = []
    for page in sorted((site / "reference").glob("*/index.html")):
        html = page.read_text(encoding="utf-8")
        wrong += [
            f"{page.parent.name}: {name} is a {kind}"
            for name, kind in kinds.findall(html)
            if kind not in ("class", "function")
        ]
    assert not wrong, wrong


def test_every_internal_link_resolves(site: Path) -> None:
    checked, problems = _tool("check_site_links").check(site)
    assert checked > 500, f"only {checked} internal links found: is {site} the whole site?"
    assert not problems, f"{len(problems)} broken internal link(s):\n" + "\n".join(problems)


def _page(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<html><body>{body}</body></html>", encoding="utf-8")


def test_link_checker_reports_each_kind_of_broken_link(tmp_path: Path) -> None:
    _page(tmp_path / "b" / "index.html", '<h2 id="usage">Usage</h2><a name="old"></a>')
    _page(
        tmp_path / "a" / "index.html",
        "\n".join(
            [
                '<h1 id="top">A</h1>',
                '<a href="../b/">fine</a> <a href="../b/index.html#usage">fine</a>',
                '<a href="/b/#old">fine: absolute, an a name</a> <a href="#top">fine</a>',
                '<a href="https://example.com/x">another site</a> <a href="mailto:x@y">mail</a>',
                '<a href="../b/#missing">no such anchor</a>',
                '<a href="../c/">no such page</a>',
                '<img src="../img/plot.png">',
                '<a href="#nowhere">no such anchor here</a>',
                '<a href="../../../etc/passwd">out of the site</a>',
            ]
        ),
    )
    checked, problems = _tool("check_site_links").check(tmp_path)
    assert checked == 9
    assert [p.split(": ", 1)[1] for p in problems] == [
        "../b/#missing (no id 'missing' in that page)",
        "../c/ (no such file in the site)",
        "../img/plot.png (no such file in the site)",
        "#nowhere (no id 'nowhere' in that page)",
        "../../../etc/passwd (no such file in the site)",
    ]
    assert problems[0].startswith("a/index.html:5: ")


def test_strict_build_fails_on_a_link_to_a_missing_anchor(tmp_path: Path) -> None:
    """mkdocs.yml's validation settings turn a Markdown link to a missing anchor (or page) into
    a warning, which --strict makes an error."""
    _need_mkdocs()
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    tiny = {
        "site_name": "tiny",
        "docs_dir": "docs",
        "theme": {"name": "material"},
        "validation": config["validation"],
        "markdown_extensions": [
            e for e in config["markdown_extensions"] if "snippets" not in str(e)
        ],
        "nav": ["index.md", "other.md"],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(tiny), encoding="utf-8")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Usage\n", encoding="utf-8")
    index = tmp_path / "docs" / "index.md"
    index.write_text("# Home\n\n[fine](other.md#usage)\n", encoding="utf-8")
    assert _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site").returncode == 0
    index.write_text("# Home\n\n[broken](other.md#use)\n", encoding="utf-8")
    proc = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    assert "does not contain an anchor '#use'" in proc.stderr


def test_api_reference_documents_every_name_in_phalanx_all() -> None:
    import phalanx

    pages = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs/reference").glob("*.md"))
    # `::: phalanx.NAME`, or the defining module's path with `heading: phalanx.NAME` where a
    # submodule of the same name would shadow it (phalanx.spawn, phalanx.main_first)
    rendered = set(re.findall(r"^::: phalanx\.(\w+)$", pages, re.MULTILINE))
    rendered |= set(re.findall(r"^ +heading: phalanx\.(\w+)$", pages, re.MULTILINE))
    mentioned_only = {"__version__", "ReduceOp"}  # a string, and torch's own class
    missing = sorted(set(phalanx.__all__) - rendered - mentioned_only)
    assert not missing, f"in phalanx.__all__ but on no docs/reference page: {missing}"
    for name in mentioned_only:
        assert f"phalanx.{name}" in pages


def _github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation but ``-``
    and ``_`` dropped, each space a ``-``, ``-1``, ``-2`` ... on repeats); fenced code skipped."""
    anchors: set[str] = set()
    in_fence = False
    for line in markdown.splitlines():
        if re.match(r"\s*(```|~~~)", line):
            in_fence = not in_fence
        heading = None if in_fence else re.match(r"#{1,6} +(.*?) *#*$", line)
        if heading is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_readme_links_into_the_repository_resolve_on_github() -> None:
    """The README is read on GitHub: its relative links (docs/*.md and their #anchors,
    examples/...) must name files of the repository and headings GitHub makes anchors of."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    readme = re.sub(r"^```.*?^```", "", readme, flags=re.MULTILINE | re.DOTALL)
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    problems = []
    for link in links:
        if re.match(r"[a-z]+:", link) or link.startswith("#"):
            continue  # another site, or a heading of the README itself
        path, _, anchor = link.partition("#")
        target = ROOT / path
        if not target.exists():
            problems.append(f"{link}: no such file")
        elif anchor and anchor not in _github_anchors(target.read_text(encoding="utf-8")):
            problems.append(f"{link}: no heading of {path} makes the anchor #{anchor}")
    assert any(link.startswith("docs/") for link in links), "the README links into docs/"
    assert not problems, problems


def test_benchmark_page_is_up_to_date() -> None:
    changed = _tool("bench_page").write(check=True)
    assert not changed, f"out of date, run `python tools/bench_page.py`: {changed}"


def test_bench_page_takes_command_machine_and_date_from_the_file_or_says_not_recorded() -> None:
    bench_page = _tool("bench_page")
    facts = bench_page.read_facts(
        "# phalanx bench comm --shm --min-bytes 1MiB, three runs\n"
        "# 2026-11-28, 2-core AMD EPYC, 23 GiB, torch 2.13.0+cpu; load average 0.0\n"
        "  measured: op=all_reduce\n"
    )
    assert facts.commands == ["phalanx bench comm --shm --min-bytes 1MiB"]
    assert (facts.machine, facts.date) == (
        "2-core AMD EPYC, 23 GiB, torch 2.13.0+cpu",
        "2026-11-28",
    )
    shell = bench_page.read_facts(
        "$ phalanx bench hosts_backend --repeats 4\n"
        " 13:32:37 up  8:10,  0 user,  load average: 13.89, 15.89, 18.40\n"
        "Sun Nov 29 13:32:37 UTC 2026\n"
    )
    assert shell.commands == ["phalanx bench hosts_backend --repeats 4"]
    assert (shell.machine, shell.date) == ("not recorded", "2026-11-29")
    printed = bench_page.read_facts(
        "phalanx bench checkpoint: results go to runs/bench-checkpoint-20261128-021243/\n"
    )
    assert printed.commands == ["phalanx bench checkpoint (its options not recorded)"]
    assert printed.date == "2026-11-28"
    bare = bench_page.read_facts("run 0: killed rank 3 before step 7: OK\n")
    assert (bare.commands, bare.machine, bare.date) == ([], "not recorded", "not recorded")
    output = "# cmd\n  measured: x=1\ntable\nRESULT {}\n\n"
    assert bench_page.shown_output(output) == "# cmd\ntable"
