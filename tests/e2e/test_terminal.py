"""``phalanx run`` at a terminal: a live progress bar, pdb and input() in rank 0, one prefix.

The launcher runs on a real pseudo-terminal with a window size (without one tqdm prints
nothing) as its controlling terminal, in its own session; the test reads the terminal as the
output arrives, answers prompts, and kills the whole session if the deadline passes.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from tests.e2e.launching import DEADLINE_S, ROOT, SCRIPTS, finish, launcher_env, start

LAUNCH = [sys.executable, "-m", "phalanx.launch", "--standalone", "--nproc-per-node", "2"]
HUMAN_S = 0.5
"""A person answers a prompt after this long at the earliest (the launcher notices a prompt
waiting for input after 50 ms, and prefixes what follows the user's Enter)."""

pytestmark = pytest.mark.timeout(180)


def _take_terminal() -> None:
    """In the child, after setsid: make the pty (its stdin) the controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A launcher on a pseudo-terminal of 24 x 80; ``read_until`` collects what it shows."""

    def __init__(self, script: str) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.proc = subprocess.Popen(
            [*LAUNCH, str(SCRIPTS / script)],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=launcher_env(),
            cwd=ROOT,
            start_new_session=True,
            preexec_fn=_take_terminal,
        )
        os.close(slave)
        self.shown = b""
        self.typed_at = 0
        self.deadline = time.monotonic() + DEADLINE_S

    def read_until(self, done: Callable[[bytes], bool]) -> bytes:
        """Read until ``done(everything shown)`` or end of output; fail at the deadline."""
        while not done(self.shown):
            left = self.deadline - time.monotonic()
            assert left > 0, f"deadline passed; the terminal shows:\n{self.shown.decode()}"
            if not select.select([self.master], [], [], min(left, 0.5))[0]:
                continue
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: every process closed the terminal
                break
            if not chunk:
                break
            self.shown += chunk
        return self.shown

    def answer(self, prompt: bytes, text: str) -> None:
        """When ``prompt`` shows after what was typed last, type ``text`` as a person would."""
        self.read_until(lambda shown: prompt in shown[self.typed_at :])
        time.sleep(HUMAN_S)
        self.typed_at = len(self.shown)
        os.write(self.master, text.encode())

    def finish(self) -> int:
        self.read_until(lambda _: False)
        return self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        os.close(self.master)


@contextmanager
def terminal(script: str) -> Iterator[Terminal]:
    term = Terminal(script)
    try:
        yield term
    finally:
        term.kill()


def test_a_tqdm_bar_moves_live_with_the_prefix_kept() -> None:
    with terminal("tqdm_bar.py") as term:
        before_mid = term.read_until(lambda shown: b"MID-EPOCH" in shown).split(b"MID-EPOCH")[0]
        assert term.finish() == 0
    states = re.findall(rb"\r\[rank 0\] +(\d+)%\|", before_mid)
    assert len(set(states)) >= 3, f"bar states before mid-epoch: {states}\n{before_mid!r}"
    # After every carriage return that does not end a line, the prefix comes first.
    redraws = re.findall(rb"\r(?!\n)(.{0,9})", term.shown)
    assert redraws and all(r == b"[rank 0] " for r in redraws), redraws
    assert b"[rank 1] END" in term.shown and b"[rank 0] END" in term.shown


def test_breakpoint_and_input_in_rank_0() -> None:
    with terminal("debug_rank0.py") as term:
        term.answer(b"(Pdb) ", "p answer\n")
        term.answer(b"(Pdb) ", "c\n")
        term.answer(b"your name? ", "phalanx\n")
        assert term.finish() == 0
    shown = term.shown.decode()
    assert "[rank 0] (Pdb) p answer\r\n[rank 0] 41\r\n[rank 0] (Pdb) c\r\n" in shown
    assert "[rank 0] your name? phalanx\r\n[rank 0] hello phalanx\r\n" in shown
    assert "[rank 0] DONE 42" in shown
    assert "[rank 1] DONE 42" in shown
    assert "BdbQuit" not in shown


def test_torchs_rank_prefix_is_not_doubled() -> None:
    proc = start([*LAUNCH, str(SCRIPTS / "raise_after_init.py")], launcher_env())
    _, err = finish(proc)
    assert proc.returncode == 1, err
    assert "[rank 1] Traceback (most recent call last):" in err
    assert "[rank 1] ValueError: boom after init" in err
    assert "[rank1]:" not in err
    assert "exception: ValueError: boom after init" in err


def test_lines_of_two_ranks_stay_whole() -> None:
    proc = start([*LAUNCH, str(SCRIPTS / "many_lines.py")], launcher_env())
    out, err = finish(proc)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    whole = [line for line in lines if re.fullmatch(r"\[rank (\d)\] rank \1 line \d+ end", line)]
    assert len(lines) == len(whole) == 4000, [line for line in lines if line not in whole][:5]


def test_a_jobs_own_bar_redraws_as_on_a_terminal() -> None:
    """Job's bar sees a pipe, but the launcher says its console is a terminal (and how wide)."""
    with terminal("job_bar.py") as term:
        before_mid = term.read_until(lambda shown: b"MID-EPOCH" in shown).split(b"MID-EPOCH")[0]
        assert term.finish() == 0
    states = re.findall(rb"\r\[rank 0\] [^\r\n]*?(\d+)/40", before_mid)
    assert len(set(states)) >= 3, f"bar states before mid-epoch: {states}\n{before_mid!r}"
    bars = re.findall(r"\r(\[rank 0\] [^\r\n]*\|[^\r\n]*)", term.shown.decode())
    widths = [len(line) for line in bars]
    assert widths and max(widths) <= 80, f"bar lines wider than the 80-column terminal: {widths}"
