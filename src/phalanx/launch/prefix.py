"""The rank prefix of worker lines, as a pure state machine over the chunks of one stream.

The prefix goes at each line start *and after each* ``\\r`` (a progress bar's redraw would erase
it otherwise). torch's own ``[rankN]:`` (``init_process_group``'s excepthook and c10d's C++ log
lines add it) would double ours, so it is dropped. The prefixer also remembers the open line as
shown, so that the console can redraw it after another rank's line ended it.
"""

from __future__ import annotations

import re
import string

__all__ = ["Prefixer", "line_prefix"]

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
        self.shown = b""
        """The open line as shown, prefix included (redrawn after another rank's line)."""
        self.awaiting_input = False
        """The open line is a prompt and the worker reads the terminal: the terminal's echo of
        the user's Enter ends the line, so what comes next starts a new line."""

    @property
    def open(self) -> bool:
        """True while a partial line (or a ``\\r`` redraw) of this stream is on the console."""
        return self._state in (_CR, _MID)

    def line_broken(self) -> None:
        """Another writer ended our partial line: the next content starts a new, prefixed line."""
        self._state = _BROKEN

    def resume(self) -> bytes:
        """After another writer's line, the open line to show again (b"": nothing to redraw)."""
        if self._state != _BROKEN or not self.shown:
            return b""
        self._state = _MID
        return self.shown

    def feed(self, data: bytes) -> bytes:
        """The bytes to show for ``data`` (a start that may be torch's prefix is held back)."""
        if self.awaiting_input:
            self.awaiting_input = False
            self._state, self.shown = _LINE, b""
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
                    self.shown, self._state = self.prefix, _MID
                    piece = kept
                out += piece
                self.shown += piece
        return bytes(out)

    def flush(self) -> bytes:
        """What is still held back, at end of file."""
        held, self._held = self._held, b""
        if not held:
            return b""
        self._state = _MID
        self.shown = self.prefix + held
        return self.shown

    def _separator(self, sep: bytes) -> bytes:
        self.shown = b""
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
