"""Per-rank files: the call ring, faulthandler's stuck and fatal stacks, read by a peer."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from phalanx.diagnostics import call_ring
from phalanx.diagnostics.call_ring import CallRing, read_calls
from phalanx.diagnostics.flight import Record
from phalanx.diagnostics.rank_files import Peer, fatal_signal, thread_stack
from phalanx.testing import scaled

CHILD = """
import ctypes, os, sys, threading, time
from pathlib import Path
from phalanx.diagnostics.flight import Record
from phalanx.diagnostics.rank_files import RankFiles

def hold_the_gil():
    ctypes.PyDLL(None).sleep(2)

def crash():
    os.abort()

files = RankFiles(Path(sys.argv[1]), 3)
call = Record("0", 7, "all_reduce", "[4] float32", "c.py:1 in f", time.time(), args="SUM")
files.ring.write(call)
print(os.getpid(), threading.main_thread().ident, flush=True)
time.sleep(0.3)
hold_the_gil() if sys.argv[2] == "stuck" else crash()
files.close()
"""


def _rec(seq: int) -> Record:
    return Record("g", seq, "all_reduce", "[2] float32", f"t.py:{seq} in f", float(seq), args="SUM")


def test_the_ring_keeps_the_last_calls_and_their_completion(tmp_path: Path) -> None:
    ring = CallRing(tmp_path / "r")
    for seq in range(1, call_ring.SLOTS + 11):
        ring.write(_rec(seq))
        if seq % 2:
            ring.done("g", seq, seq + 0.5)
    ring.done("g", 1, 9.0)  # long overwritten: ignored
    calls = read_calls(tmp_path / "r")
    assert calls is not None and len(calls) == call_ring.SLOTS
    assert [c.seq for c in calls] == list(range(11, call_ring.SLOTS + 11))
    assert calls[0].end == 11.5 and calls[1].end is None
    assert calls[-1].where() == f"all_reduce [2] float32 SUM at t.py:{call_ring.SLOTS + 10} in f"
    ring.close()
    assert read_calls(tmp_path / "missing") is None


def test_a_long_call_site_is_cut_not_spilled(tmp_path: Path) -> None:
    ring = CallRing(tmp_path / "r")
    long = Record("g", 1, "all_reduce", "[2] float32", "x" * 1000, 1.0, args="SUM")
    ring.write(long)
    ring.write(_rec(2))
    calls = read_calls(tmp_path / "r")
    assert calls is not None and [c.seq for c in calls] == [1, 2]  # cut, still readable
    assert calls[0].start == 1.0 and calls[0].site.startswith("xxx")
    assert len(calls[0].site) < call_ring.SLOT and calls[1].site == "t.py:2 in f"


DUMP = """Fatal Python error: Aborted

Thread 0x00007f0000000002 (most recent call first):
  File "/x/threading.py", line 9 in run

Current thread 0x00007f0000000001 (most recent call first):
  File "/t/train.py", line 12 in step
  File "/t/train.py", line 30 in <module>

Extension modules: torch._C (total: 1)
"""


def test_faulthandler_text_gives_the_signal_and_the_main_thread() -> None:
    assert fatal_signal(DUMP) == "SIGABRT"
    assert fatal_signal("Fatal Python error: Segmentation fault\n") == "SIGSEGV"
    assert fatal_signal("Timeout (0:00:01)!\n") is None
    assert thread_stack(DUMP, 0x7F0000000001) == [
        'File "/t/train.py", line 12 in step',
        'File "/t/train.py", line 30 in <module>',
    ]
    assert len(thread_stack(DUMP, 42)) == 3  # unknown thread: every frame


def _child(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], Peer]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), mode], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    pid, main = (int(x) for x in proc.stdout.readline().split())
    return proc, Peer(3, socket.gethostname(), pid, str(tmp_path), main)


def test_a_rank_holding_the_gil_leaves_a_stuck_stack(tmp_path: Path) -> None:
    proc, peer = _child(tmp_path, "stuck")
    try:
        assert peer.here() and peer.alive()
        deadline = time.monotonic() + scaled(10)
        while peer.stuck() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        stack = peer.stuck()
        assert stack is not None and "in hold_the_gil" in stack[0], stack
        calls = peer.calls()
        assert calls is not None and calls[0].seq == 7 and calls[0].end is None
    finally:
        proc.wait(timeout=scaled(20))
    assert not peer.alive() and not (tmp_path / "rank-3.calls").exists()  # clean exit: gone


def test_a_dead_rank_leaves_its_signal_stack_and_calls(tmp_path: Path) -> None:
    proc, peer = _child(tmp_path, "abort")
    assert proc.wait(timeout=scaled(20)) < 0
    assert peer.alive() is False
    death = peer.death()
    assert death is not None and death[0] == "SIGABRT" and "in crash" in death[1][0]
    calls = peer.calls()
    assert calls is not None and calls[0].where() == "all_reduce [4] float32 SUM at c.py:1 in f"
    elsewhere = Peer(3, "another-host", 1, str(tmp_path), 0)
    assert not elsewhere.here() and elsewhere.alive() is None and elsewhere.calls() is None
    assert elsewhere.where("fatal") == f"another-host:{tmp_path}/rank-3.fatal"
    # a container with the same host name but its own PID namespace / boot: not readable here
    twin = Peer(3, socket.gethostname(), peer.pid, str(tmp_path), 0, machine="other/pid:[1]")
    assert not twin.here() and twin.alive() is None and twin.calls() is None


FORKING = """
import ctypes, faulthandler, os, sys, time
from pathlib import Path
from phalanx.diagnostics.rank_files import RankFiles

files = RankFiles(Path(sys.argv[1]), 0)
for _ in range(5):  # the stuck dump is armed: a child must neither hang nor touch our files
    pid = os.fork()
    if pid == 0:
        faulthandler.dump_traceback_later(5)
        faulthandler.cancel_dump_traceback_later()
        files.close()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
assert files.path("calls").exists()
files._stop.set()  # no more re-arming: the dump armed after the last fork must fire
files._keeper.join()
ctypes.PyDLL(None).sleep(2)  # still armed in the parent: the stuck dump is written
print(files.path("stuck").read_text().count("Thread"), flush=True)
files.close()
"""


def test_a_forked_child_neither_hangs_nor_removes_the_files(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", FORKING, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=scaled(30),
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 1
    assert not (tmp_path / "rank-0.calls").exists()


BUSY = """
import sys, time
from pathlib import Path
from phalanx.diagnostics.rank_files import RankFiles

files = RankFiles(Path(sys.argv[1]), 0)
end = time.monotonic() + 2.5
while time.monotonic() < end:  # Python running, the GIL passed around: not stuck
    sum(range(1000))
print(len(files.path("stuck").read_text()), flush=True)
files.close()
"""


def test_a_rank_running_python_gets_no_stuck_dump(tmp_path: Path) -> None:
    # a dump taken while the main thread runs Python reads moving frames (it can segfault)
    out = subprocess.run(
        [sys.executable, "-c", BUSY, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=scaled(30),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
