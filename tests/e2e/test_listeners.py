"""A single-machine job listens on loopback only (stores and gloo's pairs), and its secret
travels in the workers' environment: never on a command line, never in the output."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from phalanx.testing import scaled
from tests.e2e.launching import standalone

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


def test_listeners_on_loopback_and_the_job_secret_only_in_the_environment(
    tmp_path: Path,
) -> None:
    secret = ""
    cmd = [
        *standalone(2),
        str(SCRIPT),
        str(tmp_path),
    ]
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
        # The launcher's per-job secret reaches the workers through their environment only.
        secrets = {_environ(pid).get("PHALANX_JOB_SECRET") for pid in pids[1:]}
        assert len(secrets) == 1 and len(secret := secrets.pop() or "") == 64
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                assert secret.encode() not in cmdline.read_bytes(), cmdline
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=scaled(20))
    assert secret not in out + err  # never logged


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)
