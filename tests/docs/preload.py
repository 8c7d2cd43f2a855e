"""Run ``python script.py`` without paying for ``import torch`` each time.

A python block of the docs runs as ``python snippet.py``; most of its time is the import of torch
and phalanx (~2 s on a 2-core box, more under load). :class:`Preloaded` starts one interpreter that
imports them once and then forks a child per script, as a forkserver with a preload list does. The
child is what ``python script.py`` would be, with torch and phalanx already imported: its own
session and process group, its working directory, ``sys.argv``, ``sys.path[0]`` the script's
folder, ``__name__ == "__main__"``, stdin from /dev/null, stdout and stderr to one file, an
uncaught exception printed with its traceback and exit status 1, ``sys.exit`` as usual, at the end
its threads joined, atexit handlers run and its objects freed. Nothing has computed a tensor before
the fork (importing phalanx computes none), so torch's thread pools start in the child.

What differs: a script that changes ``os.environ`` before ``import torch`` to change how torch
starts (``OMP_NUM_THREADS``, say) is too late, and at exit the modules are not torn down (only
the script's own objects are freed). Such a block belongs in a bash block
(``VAR=1 python script.py``).

Protocol, one line each: the runner writes ``{"dir", "file", "out"}`` as JSON; the server
answers ``ready`` once, then ``pid N`` when a child started and ``exit N`` when it ended
(negative: killed by that signal).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRELOAD = ("torch", "torch._dynamo", "phalanx")
"""Imported once by the server: a block's first optimizer imports torch._dynamo (2-3 s)."""


class PreloadError(RuntimeError):
    """The preloaded interpreter died or did not answer."""


class Preloaded:
    """One interpreter with torch and phalanx imported, forking a child per script."""

    def __init__(self, env: Mapping[str, str], ready_timeout: float = 120.0) -> None:
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.docs.preload import serve; serve()"],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self._buffer = b""
        if self._line(time.monotonic() + ready_timeout) != "ready":
            self.close()
            raise PreloadError("the preloaded interpreter did not start")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, directory: Path, filename: str, deadline: float) -> tuple[int | None, str, bool]:
        """Run ``python filename`` in ``directory``; past ``deadline`` seconds kill its process
        group. Returns its exit status, its output (stdout and stderr) and whether it timed out.
        """
        fd, out = tempfile.mkstemp(prefix="snippet-output-")
        os.close(fd)
        try:
            request = {"dir": str(directory), "file": filename, "out": out}
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            end = time.monotonic() + deadline
            pid = int(self._expect("pid", end + 30))
            status, timed_out = self._wait(pid, end)
            return status, Path(out).read_text(errors="replace"), timed_out
        finally:
            Path(out).unlink(missing_ok=True)

    def _wait(self, pid: int, end: float) -> tuple[int, bool]:
        try:
            status, timed_out = int(self._expect("exit", end)), False
        except TimeoutError:
            _kill(pid)
            status, timed_out = int(self._expect("exit", time.monotonic() + 30)), True
        _kill(pid)  # whatever the script left behind in its group (a daemon of its own)
        return status, timed_out

    def _expect(self, word: str, end: float) -> str:
        line = self._line(end)
        if line is None:
            raise TimeoutError(word)
        found, _, value = line.partition(" ")
        if found != word:
            self.close()
            raise PreloadError(f"expected {word!r} from the preloaded interpreter, got {line!r}")
        return value

    def _line(self, end: float) -> str | None:
        """The server's next line; None at ``end``; PreloadError when it is gone."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = end - time.monotonic()
            if left <= 0:
                return None
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise PreloadError("the preloaded interpreter exited")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the server ends at EOF
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _kill(pid: int) -> None:
    """SIGKILL the process group of ``pid`` (its own session, made first thing in the child)."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


_shared: Preloaded | None = None


def shared(env: Mapping[str, str]) -> Preloaded:
    """This process's preloaded interpreter for ``env``, started (again) when needed."""
    global _shared
    if _shared is not None and (not _shared.alive() or _shared.env != dict(env)):
        _shared.close()
        _shared = None
    if _shared is None:
        _shared = Preloaded(env)
    return _shared


@atexit.register
def _close_shared() -> None:
    if _shared is not None:
        _shared.close()


# ---- the server (runs in the preloaded interpreter) ---------------------------------------------
def serve() -> None:
    """Import torch and phalanx, then fork one child per request read from stdin."""
    for name in PRELOAD:
        __import__(name)
    _say("ready")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)  # never returns: the child exits as the script does
        _say(f"pid {pid}")
        _, status = os.waitpid(pid, 0)
        _say(f"exit {os.waitstatus_to_exitcode(status)}")


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _child(request: dict[str, str]) -> None:
    """Become ``python FILE`` in DIR, output to OUT; exit as the script does."""
    os.setsid()
    out = os.open(request["out"], os.O_WRONLY | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(os.devnull)  # noqa: SIM115 (the server's reader holds its pipe's lines)
    directory, name = request["dir"], request["file"]
    os.chdir(directory)
    sys.argv = [name]
    sys.path[0] = directory
    _exit(_run_script(os.path.join(directory, name)))


def _run_script(path: str) -> int:
    """Run the script; its exit status as the interpreter would make it."""
    try:
        _run_main(path)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:
        _print_uncaught(e)
        return 1
    return 0


def _exit(status: int) -> None:
    """End the child as the interpreter ends (its threads joined, atexit handlers run, the
    script's objects freed so that its open files are flushed, output flushed) without tearing
    down torch's modules one by one: that alone takes ~0.8 s."""
    import atexit
    import gc
    import threading

    # What the interpreter does first when the main thread ends: threading's own exit hooks
    # (concurrent.futures' and phalanx's background checkpoint writer register there), then
    # the wait for the non-daemon threads.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    main = sys.modules.get("__main__")
    if main is not None:
        main.__dict__.clear()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status & 0xFF)


def _run_main(path: str) -> None:
    """Run ``path`` as the ``__main__`` module, as the interpreter runs a script."""
    import importlib.machinery
    import tokenize
    import types

    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__spec__ = None
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    with tokenize.open(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, main.__dict__)


def _ours(filename: str) -> bool:
    return filename == __file__


def _print_uncaught(error: BaseException) -> None:
    """The traceback ``python script.py`` prints: without this module's frames."""
    tb = error.__traceback__
    while tb is not None and Path(tb.tb_frame.f_code.co_filename).name in (
        "preload.py",
        "runpy.py",
    ):
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb)
