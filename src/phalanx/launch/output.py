"""Worker output, live: each chunk forwarded as it arrives, `[rank N] ` at every line start.

A pump thread per worker stream reads its pipe with ``os.read`` (not line by line), so a
progress bar's ``\\r`` updates and a prompt without a newline (pdb's ``(Pdb) ``) appear at once.
A :class:`~phalanx.launch.prefix.Prefixer` per stream adds the rank prefix. The
:class:`Console` lets one writer at a time through and ends another rank's partial line before
writing, so lines of two ranks never mix mid-line; on a terminal it then redraws that partial
line (a progress bar, a prompt). When rank 0 reads the launcher's terminal, a partial line it
leaves while blocked reading stdin is a prompt: the user's Enter ends that line.
"""

from __future__ import annotations

import contextlib
import os
import platform
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Protocol

from phalanx.launch.prefix import Prefixer

__all__ = [
    "CONSOLE",
    "CONSOLE_ENV",
    "Console",
    "ConsoleSink",
    "FileSink",
    "Lines",
    "Sink",
    "TailSink",
    "console_env",
    "pump",
    "read_chunk",
    "reading_stdin",
]

CHUNK = 65536
IDLE_S = 0.05
"""How long a prompt must wait before the launcher checks whether it waits for input."""
COALESCE_S = 0.02
"""How long a chunk that ends inside a line waits for the rest of it: ``print(a, b)`` writes a
line in pieces, and two ranks' pieces must not split each other's lines. A progress bar or a
prompt, which end no line, is shown after at most this long."""
PIPE_COALESCE_S = 0.25
"""The same wait when neither of the launcher's stdout and stderr is a terminal (a log, a CI
job): no one watches a bar or a prompt there, and a printing worker descheduled for longer than
20 ms on a loaded machine split its line around another rank's (seen once in four full test
runs beside other work)."""
CONSOLE_ENV = "PHALANX_CONSOLE"
"""Set to ``tty`` in the workers' environment when the launcher's stderr is a terminal: their
stderr is a pipe to the launcher, but what they write ends on a terminal, so progress bars may
redraw as often as on one (see :mod:`phalanx.train.progress`)."""


def _terminal(stream: IO[str]) -> object:
    """What ``stream`` writes to: stdout and stderr on one terminal (or file) share a line."""
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino)
    except (OSError, ValueError, AttributeError):
        return id(stream)


def _is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):
        return False


def console_env(base: Mapping[str, str], prefix: str) -> dict[str, str]:
    """What a worker whose output carries ``prefix`` needs to know about the launcher's console.

    When stderr is a terminal: ``PHALANX_CONSOLE=tty``, and (unless the user set it) ``COLUMNS``,
    the terminal's width less the prefix, which tqdm reads when its own stream is no terminal.
    """
    stream = _stream("stderr")
    if not _is_tty(stream):
        return {}
    env = {CONSOLE_ENV: "tty"}
    if "COLUMNS" not in base:
        with contextlib.suppress(OSError, ValueError):
            columns = os.get_terminal_size(stream.fileno()).columns
            if columns > 0:
                env["COLUMNS"] = str(max(20, columns - len(prefix)))
    return env


def _put(stream: IO[str], data: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):
        buffer = getattr(stream, "buffer", None)
        if buffer is not None:
            buffer.write(data)
            buffer.flush()
        else:
            stream.write(data.decode("utf-8", "replace"))
            stream.flush()


def _stream(name: str) -> IO[str]:
    """The launcher's current stdout or stderr (looked up at each write: tests swap them)."""
    return sys.stdout if name == "stdout" else sys.stderr


class Console:
    """The launcher's stdout and stderr, shared by the pumps of every worker and the launcher."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[object, tuple[Prefixer, str]] = {}
        """Per terminal: the writer whose partial line is on it, and its stream."""
        self._ended: dict[object, tuple[Prefixer, str]] = {}
        """Per terminal: the writer whose partial line another writer ended (to redraw)."""

    def write(self, name: str, source: Prefixer, data: bytes, final: bool = False) -> None:
        """Show ``data`` from ``source`` on stream ``name`` (``"stdout"`` or ``"stderr"``)."""
        with self._lock:
            out = source.feed(data) + (source.flush() if final else b"")
            if not out:
                return
            stream = _stream(name)
            key = _terminal(stream)
            self._break(key, source)
            _put(stream, out)
            self._settle(key, (source, name) if source.open else None)

    def line(self, name: str, text: str) -> None:
        """Write one line of the launcher's own, after ending any worker's partial line."""
        with self._lock:
            stream = _stream(name)
            key = _terminal(stream)
            self._break(key, None)
            _put(stream, text.encode("utf-8", "replace") + b"\n")
            self._settle(key, None)

    def awaiting_input(self, source: Prefixer) -> None:
        """``source``'s open line is a prompt answered on the terminal (see Prefixer)."""
        with self._lock:
            source.awaiting_input = True

    def _break(self, key: object, source: Prefixer | None) -> None:
        """End another writer's partial line on terminal ``key`` before ``source`` writes."""
        owner = self._open.pop(key, None)
        if owner is not None and owner[0] is not source:
            _put(_stream(owner[1]), b"\n")
            owner[0].line_broken()
            self._ended[key] = owner

    def _settle(self, key: object, now_open: tuple[Prefixer, str] | None) -> None:
        """Record who has a partial line now; once the line is complete, redraw the partial
        line it ended (on a terminal: a progress bar or prompt must stay visible)."""
        if now_open is not None:
            self._open[key] = now_open
            return
        ended = self._ended.pop(key, None)
        if ended is not None and _is_tty(_stream(ended[1])):
            redraw = ended[0].resume()
            if redraw:
                _put(_stream(ended[1]), redraw)
                self._open[key] = ended


CONSOLE = Console()
"""The console of this process (the launcher has one stdout and one stderr)."""


class Sink(Protocol):
    """Where a pump copies a worker's output: the console, a log file, the stderr tail..."""

    def write(self, data: bytes) -> None:
        """Take the next chunk."""

    def close(self) -> None:
        """End of the stream."""


class ConsoleSink:
    """A worker stream shown on the console with its rank prefix."""

    def __init__(self, name: str, prefixer: Prefixer, console: Console = CONSOLE) -> None:
        self.name = name
        self.prefixer = prefixer
        self.console = console

    def write(self, data: bytes) -> None:
        self.console.write(self.name, self.prefixer, data)

    def close(self) -> None:
        self.console.write(self.name, self.prefixer, b"", final=True)

    def idle(self, pid: int) -> None:
        """No output for a while: if the worker now waits on the terminal, its line is a prompt."""
        p = self.prefixer
        if p.open and not p.awaiting_input and reading_stdin(pid):
            self.console.awaiting_input(p)


_READ_SYSCALLS = {"x86_64": (0, 19), "aarch64": (63, 65)}
"""read and readv, the calls of Python's ``input()`` / ``sys.stdin.readline()``."""


def reading_stdin(pid: int) -> bool:
    """True while process ``pid``'s main thread is blocked reading its stdin (fd 0)."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return False
    calls = _READ_SYSCALLS.get(platform.machine(), ())
    return (
        len(fields) > 1 and fields[0].isdigit() and int(fields[0]) in calls and fields[1] == "0x0"
    )


class FileSink:
    """A log file receiving the stream as it arrives (unbuffered, so ``tail -f`` follows it)."""

    def __init__(self, path: str, append: bool = False) -> None:
        # A replaced worker's process (``--recovery live``) appends to its slot's files.
        self._file = open(path, "ab" if append else "wb", buffering=0)  # noqa: SIM115

    def write(self, data: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._file.write(data)

    def close(self) -> None:
        self._file.close()


class Lines:
    """Complete lines out of chunks; of a line redrawn with ``\\r``, only what it ends with."""

    def __init__(self, take: Callable[[str], None]) -> None:
        self._take = take
        self._partial = b""

    def write(self, data: bytes) -> None:
        *complete, partial = (self._partial + data).split(b"\n")
        for line in complete:
            self._emit(line)
        # A bar redrawn for hours ends no line: keep only its last drawing, not every one.
        self._partial = _last_drawn(partial) + (b"\r" if partial.endswith(b"\r") else b"")

    def close(self) -> None:
        if self._partial:
            self._emit(self._partial)
            self._partial = b""

    def _emit(self, line: bytes) -> None:
        self._take(_last_drawn(line).decode("utf-8", "replace") + "\n")


def _last_drawn(line: bytes) -> bytes:
    """What a terminal shows of ``line``: its last non-empty ``\r`` segment."""
    return next((seg for seg in reversed(line.split(b"\r")) if seg), b"")


class TailSink(Lines):
    """The last lines of a stream (the failure summary quotes a worker's last stderr lines)."""

    def __init__(self, tail: deque[str]) -> None:
        super().__init__(tail.append)


def read_chunk(fd: int, coalesce: float = COALESCE_S) -> bytes:
    """What ``fd`` has now; when it ends inside a line, with what follows within ``coalesce``
    seconds."""
    data = os.read(fd, CHUNK)
    deadline = time.monotonic() + coalesce
    while data and not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        more = os.read(fd, CHUNK)
        if not more:  # end of file: the next read says so again
            break
        data += more
    return data


def pump(src: IO[bytes], sinks: Sequence[Sink], idle: Callable[[], None] | None = None) -> None:
    """Copy ``src`` to every sink chunk by chunk, as the bytes arrive, until end of file.

    With ``idle``, it is called after every ``IDLE_S`` without output. A chunk ending inside a
    line waits ``COALESCE_S`` for the rest when the launcher's console is a terminal, else
    ``PIPE_COALESCE_S``.
    """
    fd = src.fileno()
    on_terminal = _is_tty(sys.stdout) or _is_tty(sys.stderr)
    coalesce = COALESCE_S if on_terminal else PIPE_COALESCE_S
    try:
        while True:
            try:
                if idle is not None and not select.select([fd], [], [], IDLE_S)[0]:
                    idle()
                    continue
                data = read_chunk(fd, coalesce)
            except OSError:
                break
            if not data:
                break
            for sink in sinks:
                sink.write(data)
    finally:
        for sink in sinks:
            sink.close()
        src.close()
