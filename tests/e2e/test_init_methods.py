"""Seed 004's init methods, each process started by hand as a user would: tcp://, file://, env://."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.testing import scaled

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "init_methods.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_pair(args_for_rank, env_for_rank=lambda r: {}) -> list[str]:  # type: ignore[no-untyped-def]
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, **env_for_rank(rank)}
            procs.append(
                subprocess.Popen(
                    [sys.executable, EXAMPLE, *args_for_rank(rank)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=env,
                )
            )
        outs = [p.communicate(timeout=scaled(60))[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    return outs


def test_tcp_init_method() -> None:
    url = f"tcp://127.0.0.1:{_free_port()}"
    outs = _run_pair(lambda r: ["--init-method", url, "--rank", str(r), "--world-size", "2"])
    assert all("sum=3" in o for o in outs)


def test_file_init_method(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'rendezvous'}"
    outs = _run_pair(lambda r: ["--init-method", url, "--rank", str(r), "--world-size", "2"])
    assert all("sum=3" in o for o in outs)


def test_env_init_method_without_launcher() -> None:
    port = str(_free_port())
    outs = _run_pair(
        lambda r: ["--init-method", "env://"],
        lambda r: {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "TORCHELASTIC_USE_AGENT_STORE": "",
        },
    )
    assert all("sum=3" in o for o in outs)


def test_unreachable_tcp_store_names_address() -> None:
    port = _free_port()
    proc = subprocess.run(
        [
            sys.executable,
            EXAMPLE,
            "--init-method",
            f"tcp://127.0.0.1:{port}",
            "--rank",
            "1",
            "--world-size",
            "2",
            "--timeout",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert f"127.0.0.1:{port}" in proc.stderr


@pytest.mark.parametrize("scheme", ["tcp"])
def test_rank0_store_listens_on_given_address_only(scheme: str) -> None:
    # Rank 0 alone: it hosts the store, then waits for rank 1, which never comes.
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            EXAMPLE,
            "--init-method",
            f"{scheme}://127.0.0.1:{port}",
            "--rank",
            "0",
            "--world-size",
            "2",
            "--timeout",
            "20",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        addrs = _wait_listening(port)
        assert addrs == {"0100007F"}, addrs  # 127.0.0.1, not 00000000 (every interface)
    finally:
        proc.kill()
        proc.wait()


def _wait_listening(port: int, deadline_s: float = 20) -> set[str]:
    import time

    end = time.monotonic() + scaled(deadline_s)
    while time.monotonic() < end:
        found = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    addr, hexport = local.rsplit(":", 1)
                    if state == "0A" and int(hexport, 16) == port:
                        found.add(addr)
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on port {port}")
