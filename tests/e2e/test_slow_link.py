"""``slow_link``: two network namespaces over a veth whose rate ``tc tbf`` caps.

A sender in one namespace pushes bytes to a receiver in the other; the measured rate must be
close to the cap (within what tbf's burst allows) and far below the uncapped veth's.
"""

from __future__ import annotations

import sys

import pytest

from phalanx.bench.slow_link import LinkError, slow_link, unavailable
from phalanx.testing import scaled

pytestmark = pytest.mark.netns

RECEIVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; start = None
while b := c.recv(1 << 20):
    start = start or time.monotonic(); n += len(b)
print(n * 8 / 1e6 / (time.monotonic() - start), flush=True)
"""
SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.sendall(b"x" * int(sys.argv[3])); c.close()
"""


def _measure_mbit(mbit: float | None, nbytes: int) -> float:
    with slow_link(mbit) as link:
        receiver = link.popen(1, [sys.executable, "-c", RECEIVER, link.addr[1]])
        try:
            assert receiver.stdout is not None
            port = receiver.stdout.readline().strip()
            sender = link.popen(0, [sys.executable, "-c", SENDER, link.addr[1], port, str(nbytes)])
            assert sender.wait(timeout=scaled(60)) == 0, sender.communicate()
            out, err = receiver.communicate(timeout=scaled(60))
            assert receiver.returncode == 0, err
        finally:
            receiver.kill()
        return float(out.strip())


def test_the_link_runs_at_its_cap() -> None:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    try:
        capped = _measure_mbit(40, 2_000_000)  # 0.4 s at 40 Mbit/s
    except LinkError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    assert 28 <= capped <= 48, capped
    assert _measure_mbit(None, 20_000_000) > 200  # the veth alone: far faster


def test_a_bad_rate_is_named() -> None:
    expected = "mbit must be a number > 0 or None, got -1"
    with pytest.raises(ValueError, match=expected), slow_link(-1):
        pass
