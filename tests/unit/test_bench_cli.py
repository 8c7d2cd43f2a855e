"""``phalanx bench --help`` (issue 36, item 4): every suite with one line, and the flags that
every suite takes, which each suite's own parser does take."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import phalanx.bench
from phalanx import cli
from phalanx.bench import SUITES
from phalanx.bench.common import COMMON_FLAGS


def test_help_lists_every_suite_and_the_common_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: phalanx bench SUITE [--quick] [--out DIR] [--json PATH]")
    for name, what in SUITES.items():
        assert re.search(rf"^  {name} +{re.escape(what)}$", out, re.M), name
    for flag, what in COMMON_FLAGS:
        assert re.search(rf"^  {re.escape(flag)} +{re.escape(what)}$", out, re.M), flag
    assert [flag for flag, _ in COMMON_FLAGS] == ["--quick", "--out DIR", "--json PATH"]
    assert max(len(line) for line in out.splitlines()) <= 100


def test_no_suite_or_an_unknown_one_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench"]) == 2
    assert "flags every suite takes:" in capsys.readouterr().err
    assert cli.main(["bench", "zer0"]) == 2
    assert capsys.readouterr().err == (
        f"phalanx bench: unknown suite 'zer0'; one of {', '.join(SUITES)} (phalanx bench --help)\n"
    )


def test_the_list_is_every_benchmark_module() -> None:
    """A suite is a module of phalanx.bench with ``main(argv)`` and its own ``prog``."""
    folder = Path(phalanx.bench.__file__).parent
    found = {
        p.stem for p in folder.glob("*.py") if f'prog="phalanx bench {p.stem}"' in p.read_text()
    }
    assert found == set(SUITES)


@pytest.mark.parametrize("suite", list(SUITES))
def test_each_suite_takes_the_common_flags(suite: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(f"phalanx.bench.{suite}")
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag, _ in COMMON_FLAGS:
        assert f"[{flag}]" in text, (suite, flag)
