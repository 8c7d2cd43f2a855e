"""Launchers on namespace hosts (``phalanx.bench.hosts``): make the hosts, start one launcher
per host, stop it for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.bench.hosts import Hosts, HostsError, namespace_hosts, unavailable
from tests.e2e.launching import ROOT

__all__ = ["LAUNCH", "host_env", "make_hosts", "start_on", "stop"]

LAUNCH = [sys.executable, "-m", "phalanx.launch"]


def make_hosts(n: int, shared: Path, mbit: float | None = None) -> Iterator[Hosts]:
    """``n`` hosts that all see ``shared`` and this checkout (its tests' scripts), wherever it
    is (a fixture's body); skip where they cannot be made."""
    if (why := unavailable()) is not None:
        pytest.skip(why)
    try:
        with namespace_hosts(n, mbit, shared=[shared, ROOT]) as hosts:
            yield hosts
    except HostsError as exc:
        pytest.skip(f"cannot create namespace hosts here: {exc}")


def host_env(**extra: str) -> dict[str, str]:
    """This environment for a launcher on a host: our ``src`` first, no interface pin."""
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return {**env, **extra}


def start_on(hosts: Hosts, host: int, *args: str, **env: str) -> subprocess.Popen[str]:
    """``phalanx.launch *args`` on ``host`` (its own session)."""
    return hosts.popen(host, [*LAUNCH, *args], env=host_env(**env))


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the launcher (it stops its workers), SIGKILL its process group if it hangs."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
