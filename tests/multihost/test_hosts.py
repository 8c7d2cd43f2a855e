"""``bench.hosts``: namespace hosts are separate machines to the processes on them.

Each host has its own host name, address, ``/dev/shm`` and ``/tmp``, sees the shared directory,
reaches the others over the bridge (not after :meth:`Hosts.cut`, again after
:meth:`Hosts.mend`), and a capped link runs at its cap. Nothing is left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.bench.hosts import Hosts, HostsError, namespace_hosts, unavailable
from phalanx.testing import scaled

pytestmark = pytest.mark.netns

LOOK = """
import json, os, socket, sys
from pathlib import Path
open("/dev/shm/mine", "w").close(); Path("/tmp/mine").write_text(socket.gethostname())
print(json.dumps({"name": socket.gethostname(), "shm": sorted(os.listdir("/dev/shm")),
                  "tmp": sorted(os.listdir("/tmp")), "shared": Path(sys.argv[1]).read_text(),
                  "cwd": os.getcwd()}))
"""
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
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
c.sendall(b"x" * int(sys.argv[3])); c.close()
"""


def _run(hosts: Hosts, host: int, *argv: str) -> str:
    proc = hosts.popen(host, [sys.executable, "-c", *argv])
    out, err = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 0, err
    return out


def _send(hosts: Hosts, src: int, dst: int, nbytes: int, timeout: float = 30) -> float | None:
    """Mbit/s of ``nbytes`` sent from host ``src`` to ``dst``, None if it cannot connect."""
    receiver = hosts.popen(dst, [sys.executable, "-c", RECEIVER, hosts.addr[dst]])
    try:
        assert receiver.stdout is not None
        port = receiver.stdout.readline().strip()
        argv = [sys.executable, "-c", SENDER, hosts.addr[dst], port, str(nbytes), str(timeout)]
        sender = hosts.popen(src, argv)
        if sender.wait(timeout=scaled(60) + timeout) != 0:
            return None
        out, err = receiver.communicate(timeout=scaled(60))
        assert receiver.returncode == 0, err
        return float(out.strip())
    finally:
        receiver.kill()
        receiver.communicate()


def test_each_host_is_its_own_machine_and_sees_the_shared_directory(tmp_path: Path) -> None:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    (tmp_path / "note").write_text("shared")
    with namespace_hosts(3, shared=[tmp_path], prefix="box") as hosts:
        seen = [json.loads(_run(hosts, h, LOOK, str(tmp_path / "note"))) for h in range(3)]
        namespaces = set(hosts.ns) | {hosts.switch}
        assert namespaces <= set(
            subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout.split()
        )
        assert _send(hosts, 0, 2, 1000) is not None
        hosts.cut(2)
        assert _send(hosts, 0, 2, 1000, timeout=1) is None  # no route while the link is down
        hosts.mend(2)
        assert _send(hosts, 0, 2, 1000) is not None
    assert [s["name"] for s in seen] == ["box0", "box1", "box2"]
    for s in seen:
        assert s["shm"] == ["mine"], seen  # not the others' files, nor this machine's
        assert s["shared"] == "shared" and s["cwd"] == str(Path.cwd())
    left = subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
    assert not namespaces & set(left.split()), left  # every namespace deleted
    assert not Path("/dev/shm/mine").exists()


def test_a_capped_link_runs_at_its_cap(tmp_path: Path) -> None:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    try:
        with namespace_hosts(2, 40, shared=[tmp_path]) as hosts:
            capped = _send(hosts, 0, 1, 2_000_000)  # 0.4 s at 40 Mbit/s
        with namespace_hosts(2, shared=[tmp_path]) as hosts:
            free = _send(hosts, 0, 1, 20_000_000)
    except HostsError as exc:
        pytest.skip(f"cannot create namespace hosts here: {exc}")
    assert capped is not None and 28 <= capped <= 48, capped
    assert free is not None and free > 200  # the veths alone: far faster


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"mbit": -1}, "mbit must be a number > 0 or None, got -1"),
        ({"n": 1}, r"n must be an int in 2\.\.200, got int 1"),
        ({"prefix": "a b"}, "prefix must be 1-20 letters or digits, got 'a b'"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], expected: str) -> None:
    with pytest.raises((ValueError, TypeError), match=expected), namespace_hosts(**kwargs):  # type: ignore[arg-type]
        pass
