"""Two "machines" on one host over a slow link: network namespaces, a veth pair, ``tc tbf``.

:func:`slow_link` creates two network namespaces joined by a veth pair and, given ``mbit``,
caps each direction of the link with a token-bucket filter (``tc qdisc ... tbf``), so that
traffic between processes started in the two namespaces (:meth:`Link.popen`) crosses a link of
that bandwidth, as between two machines. Each namespace has its own loopback for the ranks
inside it. On exit the namespaces, and the veth with them, are deleted.

It needs root, iproute2 and ``tc`` (:func:`unavailable` says why not, for a skip). This kernel
has ``tbf`` but not ``netem``, so the link adds bandwidth limits and the queueing delay they
cause, not a fixed propagation delay.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["Link", "LinkError", "slow_link", "unavailable"]


class LinkError(RuntimeError):
    """The namespaces or the rate limit could not be set up (the message says which command)."""


@dataclass(frozen=True)
class Link:
    """Two namespaces, the address of each end of the veth between them, and its rate."""

    ns: tuple[str, str]
    addr: tuple[str, str]
    mbit: float | None
    """The cap on each direction, in Mbit/s (None: the veth's own speed)."""

    def command(self, side: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``side`` (0 or 1)."""
        return ["ip", "netns", "exec", self.ns[side], *argv]

    def popen(
        self, side: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen[str]:
        """Start ``argv`` in namespace ``side`` in a new session (so its group can be killed),
        with text pipes for stdout and stderr unless ``kw`` says otherwise."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        return subprocess.Popen(
            self.command(side, argv), text=True, env=env, start_new_session=True, **kw
        )


def unavailable() -> str | None:
    """Why :func:`slow_link` cannot work here (not root, no ``ip`` or ``tc``), or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"needs {' and '.join(missing)} (iproute2)" if missing else None


def _run(*argv: str) -> None:
    try:
        subprocess.run(argv, check=True, capture_output=True, text=True, timeout=10)
    except subprocess.CalledProcessError as exc:
        raise LinkError(f"{' '.join(argv)} failed: {exc.stderr.strip()}") from None


def _build(link: Link, veth: tuple[str, str]) -> None:
    for ns in link.ns:
        _run("ip", "netns", "add", ns)
    _run("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
    for ns, dev, addr in zip(link.ns, veth, link.addr):
        _run("ip", "link", "set", dev, "netns", ns)
        _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        if link.mbit is not None:
            # a burst of ~2 ms at the rate (at least 16 KiB, a few packets): smooth, not bursty
            burst = max(16 * 1024, int(link.mbit * 1e6 / 8 * 0.002))
            tbf = ("tbf", "rate", f"{link.mbit}mbit", "burst", str(burst), "latency", "100ms")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)


@contextmanager
def slow_link(mbit: float | None = None) -> Iterator[Link]:
    """Two namespaces joined by a veth capped at ``mbit`` Mbit/s each way; deleted on exit.

    Raises:
        ValueError: ``mbit`` is not a number > 0 (or None).
        LinkError: naming the ``ip`` / ``tc`` command that failed (see :func:`unavailable`).
    """
    if mbit is not None and not (isinstance(mbit, int | float) and mbit > 0):
        raise ValueError(f"slow_link: mbit must be a number > 0 or None, got {mbit!r}")
    suffix = secrets.token_hex(3)
    subnet = f"10.231.{random.randrange(256)}"
    link = Link((f"phxa{suffix}", f"phxb{suffix}"), (f"{subnet}.1", f"{subnet}.2"), mbit)
    veth = (f"phxva{suffix}", f"phxvb{suffix}")
    try:
        _build(link, veth)
        yield link
    finally:
        for ns in link.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", veth[0]], capture_output=True, timeout=10)
