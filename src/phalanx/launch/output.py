"""Worker output, live: each chunk forwarded as it arrives, `[rank N] ` at every line start.

A pump thread per worker stream reads its pipe with ``os.read`` (not line by line), so a
progress bar's ``\\r`` updates and a prompt without a newline (pdb's ``(Pdb) ``) appear at once.
The :class:`Prefixer` puts the rank prefix at each line start *and after each* ``\\r`` (else the
bar's redraw would erase it) and drops torch's own ``[rankN]:`` prefix (``init_process_group``'s
excepthook and c10d's C++ log lines add it), which would double ours. The :class:`Console`
lets one writer at a time through and ends another rank's partial line before writing, so lines
of two ranks never mix mid-line.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import select
import string
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import IO, Protocol

__all__ = [
    "CONSOLE",
    "Console",
    "ConsoleSink",
    "FileSink",
    "Lines",
    "Prefixer",
    "Sink",
    "TailSink",
    "line_prefix",
    "pump",
    "reading_stdin",
]

CHUNK = 65536
IDLE_S = 0.2
"""How long a prompt must wait before the launcher checks whether it waits for input."""
_SEPARATOR = re.compile(rb"([\r\n])")
_LINE, _CR, _MID, _BROKEN = 0, 1, 2, 3
"""Where the prefixer is: at a line start, just after a ``\\r``, inside a line, or at a line
start because another writer ended its partial line (then its own newline is already out)."""


class Prefixer:
    """Insert ``prefix`` at line starts and after each ``\\r``; drop a redundant torch prefix."""

    def __init__(self, prefix: bytes, torch_prefix: bytes | None = None) -> None:
        self.prefix = prefix
        self._blank = prefix.rstrip() + b"\n"
        self._torch = torch_prefix
        self._state = _LINE
        self._held = b""

    @property
    def open(self) -> bool:
        """True while a partial line (or a ``\\r`` redraw) of this stream is on the console."""
        return self._state in (_CR, _MID)

    def line_broken(self) -> None:
        """Another writer ended our partial line: the next content starts a new, prefixed line."""
        self._state = _BROKEN

    def feed(self, data: bytes) -> bytes:
        """The bytes to show for ``data`` (a start that may be torch's prefix is held back)."""
        pieces = _SEPARATOR.split(self._held + data)  # content, separator, content, ...
        self._held = b""
        out = bytearray()
        for i, piece in enumerate(pieces):
            if i % 2:
                out += self._separator(piece)
            elif piece:
                if self._state != _MID:
                    kept = self._strip(piece, at_end=i == len(pieces) - 1)
                    if kept is None:
                        break
                    out += self.prefix
                    self._state = _MID
                    piece = kept
                out += piece
        return bytes(out)

    def flush(self) -> bytes:
        """What is still held back, at end of file."""
        held, self._held = self._held, b""
        if not held:
            return b""
        self._state = _MID
        return self.prefix + held

    def _separator(self, sep: bytes) -> bytes:
        if sep == b"\r":
            self._state = _CR
            return sep
        out = {_LINE: self._blank, _BROKEN: b""}.get(self._state, sep)  # a blank line: prefixed
        self._state = _LINE
        return out

    def _strip(self, piece: bytes, at_end: bool) -> bytes | None:
        """``piece`` without torch's ``[rankN]:`` (and one space); None: held, may be one."""
        mark = self._torch
        if mark is None:
            return piece
        if piece.startswith(mark):
            rest = piece[len(mark) :]
            if not rest and at_end:  # a space may follow in the next chunk
                self._held = piece
                return None
            return rest[1:] if rest.startswith(b" ") else rest
        if at_end and mark.startswith(piece):
            self._held = piece
            return None
        return piece


def line_prefix(template: str | None, role: str, rank: int, local_rank: int) -> str:
    """``[rank N] ``, or torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE filled in."""
    if template is None:
        return f"[rank {rank}] "
    return string.Template(template).safe_substitute(
        role_name=role, rank=rank, local_rank=local_rank
    )


def _terminal(stream: IO[str]) -> object:
    """What ``stream`` writes to: stdout and stderr on one terminal (or file) share a line."""
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino)
    except (OSError, ValueError, AttributeError):
        return id(stream)


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

    def write(self, name: str, source: Prefixer, data: bytes, final: bool = False) -> None:
        """Show ``data`` from ``source`` on stream ``name`` (``"stdout"`` or ``"stderr"``)."""
        with self._lock:
            out = source.feed(data) + (source.flush() if final else b"")
            if not out:
                return
            stream = _stream(name)
            key = _terminal(stream)
            self._end_line_of_other(key, source)
            _put(stream, out)
            if source.open:
                self._open[key] = (source, name)
            else:
                self._open.pop(key, None)

    def line(self, name: str, text: str) -> None:
        """Write one line of the launcher's own, after ending any worker's partial line."""
        with self._lock:
            stream = _stream(name)
            self._end_line_of_other(_terminal(stream), None)
            _put(stream, text.encode("utf-8", "replace") + b"\n")

    def answered(self, source: Prefixer) -> None:
        """``source``'s open line is a prompt the user answers on the terminal, whose echo of
        Enter ends the line: give up the line, and prefix what ``source`` writes next."""
        with self._lock:
            for key, (owner, _) in list(self._open.items()):
                if owner is source:
                    source.line_broken()
                    del self._open[key]

    def _end_line_of_other(self, key: object, source: Prefixer | None) -> None:
        owner = self._open.get(key)
        if owner is not None and owner[0] is not source:
            _put(_stream(owner[1]), b"\n")
            owner[0].line_broken()
            del self._open[key]


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
        if self.prefixer.open and reading_stdin(pid):
            self.console.answered(self.prefixer)


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

    def __init__(self, path: str) -> None:
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115

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
        *complete, self._partial = (self._partial + data).split(b"\n")
        for line in complete:
            self._emit(line)

    def close(self) -> None:
        if self._partial:
            self._emit(self._partial)
            self._partial = b""

    def _emit(self, line: bytes) -> None:
        shown = next((seg for seg in reversed(line.split(b"\r")) if seg), b"")
        self._take(shown.decode("utf-8", "replace") + "\n")


class TailSink(Lines):
    """The last lines of a stream (the failure summary quotes a worker's last stderr lines)."""

    def __init__(self, tail: deque[str]) -> None:
        super().__init__(tail.append)


def pump(src: IO[bytes], sinks: Sequence[Sink], idle: Callable[[], None] | None = None) -> None:
    """Copy ``src`` to every sink chunk by chunk, as the bytes arrive, until end of file.

    With ``idle``, it is called after every ``IDLE_S`` without output.
    """
    fd = src.fileno()
    try:
        while True:
            try:
                if idle is not None and not select.select([fd], [], [], IDLE_S)[0]:
                    idle()
                    continue
                data = os.read(fd, CHUNK)
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
