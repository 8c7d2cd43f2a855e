"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

- A line ``<!-- phalanx-help: run -->`` in a page becomes the text ``phalanx run --help``
  prints, taken from the parser when the site is built, so the CLI reference cannot drift from
  the code. On GitHub the comment is invisible and the page says where the help comes from.
- Docstrings are written for Python's help() and use a little reST: roles (``:func:`~a.b```,
  which Markdown shows as the role's name before a code span) and ``text::`` before an indented
  example (which Markdown shows as code already). In the rendered HTML the role names and their
  ``~`` go, ``text::`` becomes ``text:`` and a lone ``::`` paragraph goes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import sys
from pathlib import Path
from typing import Any

if importlib.util.find_spec("phalanx") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

_HELP_MARKER = re.compile(r"^<!-- phalanx-help: ([a-z ]+) -->$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):<code>~?")
_LITERAL_MARK = re.compile(r"<p>::</p>\n?|(?<=[^:\s])::(?=</p>)")
_help_cache: dict[str, str] = {}


def phalanx_help(command: str) -> str:
    """The text ``phalanx COMMAND --help`` prints, 100 columns wide, without running a command."""
    if command not in _help_cache:
        from phalanx import cli

        out = io.StringIO()
        saved = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; the page is fixed width
        try:
            # argparse exits after printing the help
            with (
                contextlib.redirect_stdout(out),
                contextlib.redirect_stderr(out),
                contextlib.suppress(SystemExit),
            ):
                cli.main([*command.split(), "--help"])
        finally:
            if saved is None:
                os.environ.pop("COLUMNS", None)
            else:
                os.environ["COLUMNS"] = saved
        text = out.getvalue().rstrip()
        if not text.startswith("usage:"):
            raise RuntimeError(f"`phalanx {command} --help` printed no usage:\n{text}")
        _help_cache[command] = text
    return _help_cache[command]


def _help_block(match: re.Match[str]) -> str:
    command = match.group(1).strip()
    return f"```text\n$ phalanx {command} --help\n{phalanx_help(command)}\n```"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill in the ``phalanx-help`` markers."""
    return _HELP_MARKER.sub(_help_block, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """reST left in docstrings: ``:func:<code>~x</code>`` -> ``<code>x</code>``, ``text::``
    before an example -> ``text:``."""
    html = _ROLE.sub("<code>", html)
    return _LITERAL_MARK.sub(lambda m: ":" if m.group(0) == "::" else "", html)
