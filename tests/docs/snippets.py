"""Run every fenced code block of README.md and docs/**/*.md, so that no snippet can rot.

The convention (a page's author writes to it; this module enforces it):

- Every fenced block (``` or ~~~, at any indentation: in lists, admonitions, tabs) has a
  language tag. ``text`` and ``console-output`` blocks are output shown to the reader, and
  ``toml``, ``json`` and ``yaml`` blocks are files shown to the reader: none of them runs.
- A ``python`` block runs as ``python snippet_LINE.py`` (forked from an interpreter that has
  imported torch and phalanx already, ~2 s less a block: ``tests/docs/preload.py`` says what
  that changes; ``--no-preload`` starts a fresh one); a ``bash`` block runs with
  ``bash -euo pipefail``. The blocks of one page run in order, in one fresh temporary directory
  of that page, which holds links to the repository's ``examples/`` and ``benchmarks/``; PATH
  starts with the venv's bin (``phalanx``, ``python``, ``torchrun``) and PYTHONPATH holds
  ``src`` and the repository root, so ``phalanx`` and ``examples`` import.
- An HTML comment on the line just before the fence changes that, its parts separated by ``;``:

  - ``<!-- run: phalanx run --standalone --nproc-per-node 2 -->``: a python block is saved and
    run with that command (the command, then the saved file's name);
  - ``<!-- save: train.py -->``: the block is saved under that name and not run (a later block
    runs it); with ``run:`` too, it is saved under that name and run;
  - ``<!-- tested-by: tests/e2e/test_x.py::test_name -->``: the block is what that test runs
    (an end-to-end test that also checks the output): it is not run twice. The test must
    exist and its file must name every file of the repository the block names (checked);
  - ``<!-- not-run: REASON -->``: the block is not run, for that reason (a second machine, the
    network, ``make test`` itself); a reason is required;
  - ``<!-- expect-exit: N -->``: the run must exit N (else 0).

- Every run has a deadline (60 s); past it, its whole process group is killed.
- A block without a language tag, in an unknown language, or after an unknown comment, an
  annotation comment not just before a fence, or a fence left open is an error that names the
  file and line.
- A block whose only line is ``--8<-- "path"`` (pymdownx.snippets' include, should the site
  include a file of the repository) runs that file.

Command line::

    python -m tests.docs.snippets [FILES...]          # run; README.md and docs/ by default
    python -m tests.docs.snippets --list [FILES...]   # list the blocks and what is done to each
    python -m tests.docs.snippets --keep docs/job.md  # keep the page's directory to look at
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tests.docs.preload import shared as preload_server

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0
LINKED = ("examples", "benchmarks")
"""Folders of the repository that every page's directory links to."""

RUN_LANGS = ("python", "bash")
SHOWN_LANGS = ("text", "console-output", "toml", "json", "yaml")
"""Blocks shown to the reader and never run: output, and files (which ``save:`` can write)."""

KEYS = ("run", "save", "not-run", "tested-by", "expect-exit")

# Variables a launcher sets for its workers: a snippet starts as a user's shell would.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "GLOO_SOCKET_IFNAME",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_QUOTED_FENCE = re.compile(r"^\s*>\s*(`{3,}|~{3,})")
_COMMENT = re.compile(r"^\s*<!--(?P<body>.*?)-->\s*$")
_PARTS = re.compile(r";\s*(?=(?:" + "|".join(KEYS) + r")\s*:)")
_INCLUDE = re.compile(r'^--8<--\s+"(?P<path>[^"]+)"\s*$')


class SnippetError(ValueError):
    """A page breaks the convention; the message names the file and line of every problem."""


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page, with what its comment asks."""

    page: Path
    line: int  # of the opening fence, from 1
    end: int  # of the closing fence
    lang: str
    code: str
    run: str | None = None
    save: str | None = None
    not_run: str | None = None
    tested_by: str | None = None
    expect_exit: int = 0

    @property
    def where(self) -> str:
        return f"{display(self.page)}:{self.line}"

    @property
    def action(self) -> str:
        """What the runner does with it: ``shown``, ``saved``, ``not-run``, ``tested-by`` or
        ``run``."""
        if self.lang in SHOWN_LANGS:
            return "saved" if self.save else "shown"
        if self.not_run is not None:
            return "not-run"
        if self.tested_by is not None:
            return "tested-by"
        if self.save and self.run is None:
            return "saved"
        return "run"

    @property
    def filename(self) -> str:
        """The name it is saved under in the page's directory."""
        suffix = ".sh" if self.lang == "bash" else ".py"
        return self.save or f"snippet_{self.line}{suffix}"

    def command(self) -> list[str]:
        """The command that runs it, in the page's directory."""
        name = self.filename
        if self.lang == "bash":
            return ["bash", "-euo", "pipefail", name]
        if self.run is not None:
            return ["bash", "-c", f"{self.run} {shlex.quote(name)}"]
        return ["python", name]


@dataclass(frozen=True)
class Outcome:
    """What became of one block."""

    block: Block
    status: str  # passed, failed, timeout, not-run, tested-by, shown, saved
    seconds: float = 0.0
    returncode: int | None = None
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.status not in ("failed", "timeout")

    def describe(self) -> str:
        b = self.block
        head = f"{b.where}  {b.lang}  {self.status}"
        if self.status in ("passed", "failed", "timeout"):
            head += f"  {self.seconds:.1f} s"
        if self.status == "failed":
            head += f" (exit {self.returncode}, expected {b.expect_exit})"
        if self.status == "not-run":
            head += f": {b.not_run}"
        if self.status == "tested-by":
            head += f": {b.tested_by}"
        return head


def display(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


# ---- parsing ------------------------------------------------------------------------------------
def parse_page(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` (see :func:`parse`)."""
    return parse(page.read_text(encoding="utf-8"), page)


def parse(text: str, page: Path) -> list[Block]:
    """The fenced blocks of ``text``, with their comments applied.

    Raises:
        SnippetError: naming ``page`` and the line of every block or comment that breaks the
            convention.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    errors: list[str] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            errors += _stray(lines, i, page)
            i += 1
            continue
        end = _closing(lines, i, opening)
        if end is None:
            errors.append(f"{display(page)}:{i + 1}: the fence opened here is never closed")
            break
        try:
            blocks.append(_block(page, lines, i, end, opening))
        except SnippetError as e:
            errors.append(str(e))
        i = end + 1
    if errors:
        raise SnippetError("\n".join(errors))
    return blocks


def _stray(lines: list[str], i: int, page: Path) -> list[str]:
    """Problems with a line outside any fence: a fence in a block quote, or an annotation
    comment that no fence follows."""
    if _QUOTED_FENCE.match(lines[i]):
        return [f"{display(page)}:{i + 1}: a fence in a block quote is not run; take it out"]
    comment = _COMMENT.match(lines[i])
    if comment is None:
        return []
    key = comment.group("body").strip().partition(":")[0].strip()
    if key in KEYS:
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if not _FENCE.match(nxt):
            return [
                f"{display(page)}:{i + 1}: <!-- {key}: --> must be on the line just before a fence"
            ]
    return []


def _closing(lines: list[str], start: int, opening: re.Match[str]) -> int | None:
    """The line that closes the fence opened at ``start``: the same character, at least as
    many, nothing after (so a ```` block may show ``` blocks inside)."""
    fence = opening.group("fence")
    closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
    for j in range(start + 1, len(lines)):
        if closing.match(lines[j]):
            return j
    return None


def _dedent(line: str, indent: int) -> str:
    """``line`` without up to ``indent`` leading whitespace characters (the fence's own)."""
    stripped = len(line) - len(line.lstrip(" \t"))
    return line[min(stripped, indent) :]


def _block(page: Path, lines: list[str], start: int, end: int, opening: re.Match[str]) -> Block:
    where = f"{display(page)}:{start + 1}"
    info = opening.group("info").strip()
    lang = info.split()[0] if info else ""
    if not lang:
        raise SnippetError(
            f"{where}: a fenced block without a language tag "
            f"(one of {', '.join(RUN_LANGS + SHOWN_LANGS)})"
        )
    if lang not in RUN_LANGS + SHOWN_LANGS:
        raise SnippetError(
            f"{where}: unknown language {lang!r} (one of {', '.join(RUN_LANGS + SHOWN_LANGS)})"
        )
    indent = len(opening.group("indent"))
    body = [_dedent(line, indent) for line in lines[start + 1 : end]]
    code = _expand("\n".join(body) + "\n" if body else "", where)
    notes = _annotations(lines[start - 1] if start else "", where)
    block = Block(
        page,
        start + 1,
        end + 1,
        lang,
        code,
        run=notes.get("run"),
        save=notes.get("save"),
        not_run=notes.get("not-run"),
        tested_by=notes.get("tested-by"),
        expect_exit=_exit_code(notes.get("expect-exit"), where),
    )
    _check(block, notes, where)
    if block.tested_by is not None:
        check_tested_by(block)
    return block


def _expand(code: str, where: str) -> str:
    """A block whose only line is ``--8<-- "path"`` is that file of the repository."""
    included = _INCLUDE.match(code.strip())
    if included is None:
        return code
    path = ROOT / included.group("path")
    if not path.is_file():
        raise SnippetError(f"{where}: --8<-- includes {included.group('path')!r}, not a file")
    return path.read_text(encoding="utf-8")


def _annotations(previous: str, where: str) -> dict[str, str]:
    """The ``key: value`` parts of the comment on the line before a fence ({} when none)."""
    stripped = previous.strip()
    comment = _COMMENT.match(previous)
    if comment is None:
        if stripped.endswith("-->"):
            raise SnippetError(f"{where}: unknown comment before the fence: {stripped!r}")
        return {}
    notes: dict[str, str] = {}
    for part in _PARTS.split(comment.group("body").strip()):
        key, colon, value = (s.strip() for s in part.partition(":"))
        if key not in KEYS:
            raise SnippetError(
                f"{where}: unknown comment before the fence: {stripped!r} "
                f"(known: {', '.join(k + ':' for k in KEYS)} separated by ';')"
            )
        if not colon or not value:
            raise SnippetError(f"{where}: <!-- {key}: --> needs a value: {stripped!r}")
        if key in notes:
            raise SnippetError(f"{where}: {key}: given twice: {stripped!r}")
        notes[key] = value
    return notes


def _exit_code(value: str | None, where: str) -> int:
    if value is None:
        return 0
    try:
        return int(value)
    except ValueError:
        raise SnippetError(f"{where}: expect-exit: {value!r} is not an integer") from None


def _check(block: Block, notes: dict[str, str], where: str) -> None:
    """Combinations that cannot mean anything."""
    given = set(notes)
    if block.lang in SHOWN_LANGS and given - {"save"}:
        raise SnippetError(
            f"{where}: a {block.lang} block is never run; only save: applies to it "
            f"(given: {', '.join(sorted(given))})"
        )
    if "run" in given and block.lang != "python":
        raise SnippetError(f"{where}: run: is for python blocks; a bash block runs as written")
    if "not-run" in given and given & {"run", "expect-exit", "tested-by"}:
        raise SnippetError(
            f"{where}: not-run: with run:, tested-by: or expect-exit: contradicts itself"
        )
    if "tested-by" in given and given & {"run", "expect-exit"}:
        raise SnippetError(f"{where}: tested-by: with run: or expect-exit: contradicts itself")
    if "expect-exit" in given and block.action != "run":
        raise SnippetError(f"{where}: expect-exit: on a block that is not run")
    if block.save is not None:
        name = PurePosixPath(block.save)
        if name.is_absolute() or ".." in name.parts or name.parts[0] in LINKED:
            raise SnippetError(
                f"{where}: save: {block.save!r} must be a relative name in the page's "
                f"directory, outside {', '.join(LINKED)}"
            )


# ---- running ------------------------------------------------------------------------------------
def environment() -> dict[str, str]:
    """A user's shell: this environment without a launcher's variables (nor pytest's, which
    change from test to test), the venv's bin first on PATH, ``src`` and the repository on
    PYTHONPATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS
        and not k.startswith(("PET_", "TORCHELASTIC_", "PYTEST_"))
        and not (k.startswith("PHALANX_") and not k.startswith("PHALANX_TEST_"))
    }
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", os.defpath)])
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH")])
    )
    env["MPLBACKEND"] = "Agg"  # plots are written, never shown
    return env


@contextlib.contextmanager
def page_directory(page: Path, keep: bool = False) -> Iterator[Path]:
    """A fresh directory for ``page``'s blocks, linking to the repository's examples and
    benchmarks; removed afterwards unless ``keep``."""
    directory = Path(tempfile.mkdtemp(prefix=f"snippets-{page.stem}-"))
    try:
        for linked in LINKED:
            (directory / linked).symlink_to(ROOT / linked, target_is_directory=True)
        yield directory
    finally:
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)


def run_page(
    page: Path, *, deadline: float = DEADLINE_S, keep: bool = False, preload: bool = True
) -> list[Outcome]:
    """Run every block of ``page`` in order, in one fresh directory of its own; with
    ``preload``, plain python blocks fork from an interpreter that has imported torch."""
    return list(iter_page(page, deadline=deadline, keep=keep, preload=preload))


def iter_page(
    page: Path, *, deadline: float = DEADLINE_S, keep: bool = False, preload: bool = True
) -> Iterator[Outcome]:
    """:func:`run_page`, each block's outcome as soon as it has one."""
    blocks = parse_page(page)
    if not any(b.action in ("run", "saved") for b in blocks):
        yield from (_untouched(b) for b in blocks)
        return
    with page_directory(page, keep) as directory:
        if keep:
            print(f"{display(page)}: blocks run in {directory}", file=sys.stderr)
        for b in blocks:
            yield run_block(b, directory, deadline, preload)


_REPO_FILE = re.compile(r"(?<![\w./-])((?:examples|tests|tools|benchmarks)/[\w./-]+\.(?:py|sh))")


def check_tested_by(block: Block) -> None:
    """A ``tested-by:`` test exists, and its file names every file of the repository that the
    block names (so the test runs what the block shows, not something else)."""
    target = block.tested_by or ""
    path, sep, name = target.partition("::")
    file = ROOT / path
    if not sep or not name.isidentifier() or not file.is_file():
        raise SnippetError(f"{block.where}: tested-by: {target!r} is not tests/FILE.py::test_name")
    source = file.read_text(encoding="utf-8")
    if not re.search(rf"^(?:async )?def {re.escape(name)}\(", source, re.MULTILINE):
        raise SnippetError(f"{block.where}: tested-by: {path} has no test named {name}")
    for named in _REPO_FILE.findall(block.code):
        if (ROOT / named).is_file() and Path(named).name not in source:
            raise SnippetError(
                f"{block.where}: the block runs {named}, which {path} never names: "
                f"tested-by: must name the test that runs it"
            )


def _untouched(block: Block) -> Outcome:
    return Outcome(block, block.action)


def run_block(
    block: Block, directory: Path, deadline: float = DEADLINE_S, preload: bool = True
) -> Outcome:
    """Save ``block`` in ``directory`` when it runs or is saved, then run it when it runs."""
    if block.action in ("shown", "not-run"):
        return _untouched(block)
    if block.action == "tested-by":
        return _untouched(block)
    path = directory / block.filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(block.code, encoding="utf-8")
    if block.action == "saved":
        return _untouched(block)
    return _execute(block, directory, deadline, preload)


def _execute(block: Block, directory: Path, deadline: float, preload: bool) -> Outcome:
    start = time.monotonic()
    if preload and block.lang == "python" and block.run is None:
        returncode, output, timed_out = _preloaded(directory, block.filename, deadline)
    else:
        returncode, output, timed_out = _subprocess(block.command(), directory, deadline)
    seconds = time.monotonic() - start
    status = "timeout" if timed_out else "passed"
    if status == "passed" and returncode != block.expect_exit:
        status = "failed"
    if timed_out:
        output += f"\n[snippets] killed after the {deadline:.0f} s deadline\n"
    return Outcome(block, status, seconds, returncode, output)


def _preloaded(directory: Path, filename: str, deadline: float) -> tuple[int | None, str, bool]:
    """``python filename`` forked from an interpreter that has imported torch and phalanx."""
    return preload_server(environment()).run(directory, filename, deadline)


def _subprocess(
    command: list[str], directory: Path, deadline: float
) -> tuple[int | None, str, bool]:
    proc = subprocess.Popen(
        command,
        cwd=directory,
        env=environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,  # its own process group: killed whole on the deadline
    )
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        output, _ = proc.communicate()
        timed_out = True
    finally:
        _kill_group(proc.pid)  # whatever it left behind (a `&` job)
    return proc.returncode, output, timed_out


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def failures(outcomes: Sequence[Outcome], tail: int = 60) -> str:
    """A report of the failed blocks, each with the last ``tail`` lines of its output."""
    parts = []
    for o in outcomes:
        if not o.ok:
            lines = o.output.rstrip("\n").splitlines()[-tail:]
            shown = "\n".join("    " + line for line in lines)
            parts.append(f"{o.describe()}\n  $ {shlex.join(o.block.command())}\n{shown}")
    return "\n".join(parts)


# ---- command line -------------------------------------------------------------------------------
def _list(page: Path) -> None:
    for b in parse_page(page):
        details = {"run": b.run, "saved": b.save, "not-run": b.not_run, "tested-by": b.tested_by}
        detail = details.get(b.action) or ""
        if b.action == "run" and b.save:
            detail = f"{detail} (saved as {b.save})".strip()
        print(f"{b.where}  {b.lang}  {b.action}  {detail}".rstrip(), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.docs.snippets",
        description="Run the code blocks of README.md and docs/**/*.md as their comments say.",
    )
    parser.add_argument("files", nargs="*", type=Path, help="pages (default: README and docs/)")
    parser.add_argument("--list", action="store_true", help="list the blocks, run nothing")
    parser.add_argument("--keep", action="store_true", help="keep each page's directory")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds per run")
    parser.add_argument(
        "--no-preload",
        action="store_true",
        help="run python blocks in a fresh interpreter each (else forked after import torch)",
    )
    args = parser.parse_args(argv)
    outcomes: list[Outcome] = []
    errors: list[str] = []
    for page in [f.resolve() for f in args.files] or pages():
        try:
            if args.list:
                _list(page)
                continue
            ran = iter_page(
                page, deadline=args.deadline, keep=args.keep, preload=not args.no_preload
            )
            for outcome in ran:
                print(outcome.describe(), flush=True)
                outcomes.append(outcome)
        except SnippetError as e:
            print(e, flush=True)
            errors.append(str(e))
    if not args.list:
        _summary(outcomes)
    if errors:
        print(f"\n{len(errors)} page(s) break the convention:\n" + "\n".join(errors))
    return 1 if errors or not all(o.ok for o in outcomes) else 0


def _summary(outcomes: Sequence[Outcome]) -> None:
    ran = [o for o in outcomes if o.status in ("passed", "failed", "timeout")]
    print(
        f"{len(outcomes)} blocks, {len(ran)} run in {sum(o.seconds for o in ran):.1f} s, "
        f"{sum(not o.ok for o in outcomes)} failed, "
        f"{sum(o.status == 'tested-by' for o in outcomes)} run by the tests they name, "
        f"{sum(o.status == 'not-run' for o in outcomes)} not run"
    )
    bad = failures(outcomes)
    if bad:
        print("\n" + bad)


if __name__ == "__main__":
    sys.exit(main())
