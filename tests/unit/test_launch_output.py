"""The output pumps: prefixes at line starts and after ``\\r``, torch's prefix, whole lines."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from collections import deque

import pytest

from phalanx.launch.output import (
    PIPE_COALESCE_S,
    Console,
    ConsoleSink,
    TailSink,
    pump,
    read_chunk,
    reading_stdin,
)
from phalanx.launch.prefix import Prefixer


def _feed(prefixer: Prefixer, *chunks: bytes) -> bytes:
    return b"".join(prefixer.feed(c) for c in chunks) + prefixer.flush()


def test_prefix_at_every_line_start_and_after_every_carriage_return() -> None:
    p = Prefixer(b"[rank 0] ")
    assert _feed(p, b"hello\nwor", b"ld\n") == b"[rank 0] hello\n[rank 0] world\n"
    bar = _feed(Prefixer(b"[rank 0] "), b"\r 10%|#", b"\r 20%|##", b"\r100%|###\n")
    assert bar == b"\r[rank 0]  10%|#\r[rank 0]  20%|##\r[rank 0] 100%|###\n"
    assert _feed(Prefixer(b"[rank 0] "), b"a\r\nb\n") == b"[rank 0] a\r\n[rank 0] b\n"
    assert _feed(Prefixer(b"[rank 0] "), b"\n") == b"[rank 0]\n"  # a blank line keeps it


def test_a_partial_line_is_forwarded_at_once() -> None:
    p = Prefixer(b"[rank 0] ")
    assert p.feed(b"(Pdb) ") == b"[rank 0] (Pdb) "
    assert p.open


@pytest.mark.parametrize(
    "chunks",
    [
        (b"[rank3]: Traceback\n[rank3]:   File x\n",),
        (b"[ra", b"nk3]: Traceback\n[rank3]:", b"   File x\n"),
    ],
)
def test_torchs_own_rank_prefix_is_not_doubled(chunks: tuple[bytes, ...]) -> None:
    p = Prefixer(b"[rank 3] ", b"[rank3]:")
    assert _feed(p, *chunks) == b"[rank 3] Traceback\n[rank 3]   File x\n"


def test_torch_prefix_of_another_rank_and_lookalikes_stay() -> None:
    p = Prefixer(b"[rank 3] ", b"[rank3]:")
    out = _feed(p, b"[rank1]: x\n[rank3]:[W123 c10d] y\n[", b"ok]\n")
    assert out == b"[rank 3] [rank1]: x\n[rank 3] [W123 c10d] y\n[rank 3] [ok]\n"


def test_console_ends_another_ranks_partial_line(capsys: pytest.CaptureFixture[str]) -> None:
    console = Console()
    zero, one = Prefixer(b"[rank 0] "), Prefixer(b"[rank 1] ")
    console.write("stdout", zero, b"loading")
    console.write("stdout", one, b"hi\n")
    console.write("stdout", zero, b"\n")  # its own newline: the line was already ended
    console.write("stdout", zero, b"\r 50%")
    console.line("stdout", "phalanx run: note")
    console.write("stdout", zero, b"\r 60%")
    out = capsys.readouterr().out
    assert out == (
        "[rank 0] loading\n[rank 1] hi\n\r[rank 0]  50%\nphalanx run: note\n\r[rank 0]  60%"
    )


class _Terminal(io.TextIOWrapper):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_broken_prompt_is_redrawn(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = _Terminal(io.BytesIO(), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", screen)
    console = Console()
    zero, one = Prefixer(b"[rank 0] "), Prefixer(b"[rank 1] ")
    console.write("stdout", zero, b"(Pdb) ")
    console.write("stdout", one, b"done\n")
    console.awaiting_input(zero)  # the terminal echoes the user's Enter: a new line follows
    console.write("stdout", zero, b"41\n")
    shown = screen.buffer.getvalue()  # type: ignore[attr-defined]
    assert shown == b"[rank 0] (Pdb) \n[rank 1] done\n[rank 0] (Pdb) [rank 0] 41\n"


def test_pump_copies_chunks_and_keeps_the_stderr_tail(capsys: pytest.CaptureFixture[str]) -> None:
    read, write = os.pipe()
    os.write(write, b"one\ntwo\r2b\nthree")
    os.close(write)
    tail: deque[str] = deque(maxlen=2)
    sink = ConsoleSink("stderr", Prefixer(b"[rank 0] "), Console())
    pump(os.fdopen(read, "rb"), [sink, TailSink(tail)])
    assert capsys.readouterr().err == "[rank 0] one\n[rank 0] two\r[rank 0] 2b\n[rank 0] three"
    assert list(tail) == ["2b\n", "three\n"]


def test_a_line_written_in_pieces_arrives_whole() -> None:
    """print(a, b) writes a line in pieces; they are read together, a lone piece after 20 ms."""
    read, write = os.pipe()
    os.write(write, b"after recv,")
    timer = threading.Timer(0.005, lambda: os.write(write, b" rank 0 has data 2\n"))
    timer.start()
    try:
        assert read_chunk(read) == b"after recv, rank 0 has data 2\n"
        os.write(write, b"\r 10%|#")
        started = time.monotonic()
        assert read_chunk(read) == b"\r 10%|#"
        assert time.monotonic() - started < 1.0
    finally:
        timer.join()
        os.close(read)
        os.close(write)


def test_away_from_a_terminal_a_piece_waits_longer_for_the_rest_of_its_line() -> None:
    """A worker descheduled for 100 ms mid-print still gives one whole line to a log or a pipe,
    where no one watches a bar; on a terminal the piece shows after 20 ms."""
    read, write = os.pipe()
    try:
        for coalesce, expected in ((PIPE_COALESCE_S, [b"rank 0 line 0 end\n"]), (0.02, None)):
            os.write(write, b"rank 0")
            timer = threading.Timer(0.1, lambda: os.write(write, b" line 0 end\n"))
            timer.start()
            first = read_chunk(read, coalesce)
            timer.join()
            if expected is None:  # the terminal's short wait: the piece came alone
                assert first == b"rank 0" and read_chunk(read) == b" line 0 end\n"
            else:
                assert [first] == expected
    finally:
        os.close(read)
        os.close(write)


def test_reading_stdin_sees_a_process_waiting_for_input() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 10
        while not reading_stdin(proc.pid):
            assert time.monotonic() < deadline, "never seen reading its stdin"
            time.sleep(0.05)
    finally:
        proc.communicate(b"\n", timeout=10)
    assert not reading_stdin(os.getpid())


def test_the_tail_keeps_only_the_last_drawing_of_an_open_line() -> None:
    """A bar redrawn with \\r for hours ends no line: the tail must not grow with it."""
    from collections import deque

    from phalanx.launch.output import TailSink

    tail: deque[str] = deque(maxlen=5)
    sink = TailSink(tail)
    for i in range(20000):
        sink.write(b"\rstep %d" % i)
    assert len(sink._partial) < 20
    for chunk in (b"\rab", b"c\r", b"de", b"\n"):
        sink.write(chunk)
    assert list(tail) == ["de\n"]
