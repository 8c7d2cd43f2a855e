"""Every socket a single-machine job listens on is bound to loopback: stores and gloo's pairs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "gloo_sleeper.py"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _listening(inodes: set[str]) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of this process's LISTEN sockets."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    found.append(cols[1].rsplit(":", 1)[0])
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1


def test_every_listener_of_a_standalone_job_is_on_loopback(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "phalanx", "run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        files = [tmp_path / f"rank{r}" for r in (0, 1)]
        while not all(f.exists() for f in files):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.05)
        pids = [proc.pid] + [int(f.read_text()) for f in files]
        listeners = {pid: _listening(_socket_inodes(pid)) for pid in pids}
        assert all(listeners[p] for p in pids[1:]), listeners  # gloo listens in each worker
        for pid, addrs in listeners.items():
            assert set(addrs) <= LOOPBACK, f"pid {pid} listens on {addrs}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
