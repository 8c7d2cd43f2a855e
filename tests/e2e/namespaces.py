"""Launchers in two network namespaces (``slow_link``): start one per side, stop it for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from phalanx.bench.slow_link import Link, LinkError, slow_link, unavailable
from tests.e2e.launching import ROOT

__all__ = ["LAUNCH", "link_pair", "netns_env", "start_in", "stop"]

LAUNCH = [sys.executable, "-m", "phalanx.launch"]


def link_pair() -> Iterator[Link]:
    """The two namespaces (the ``pair`` fixture's body); skip where they cannot be made."""
    if (why := unavailable()) is not None:
        pytest.skip(why)
    try:
        with slow_link() as link:
            yield link
    except LinkError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")


def netns_env(**extra: str) -> dict[str, str]:
    """This environment for a launcher in a namespace: our ``src`` first, no interface pin."""
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return {**env, **extra}


def start_in(link: Link, side: int, *args: str, **env: str) -> subprocess.Popen[str]:
    """``phalanx.launch *args`` in namespace ``side`` (its own session)."""
    return link.popen(side, [*LAUNCH, *args], env=netns_env(**env))


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
