"""Several "machines" on one Linux host: namespaces on a bridge, optionally behind a slow link.

:func:`namespace_hosts` makes ``n`` hosts. Each is a long-lived holder process with its own

- network namespace: loopback, and ``eth0`` with address ``10.<a>.<b>.<i+1>/24``, a veth whose
  other end sits on a bridge in a separate "switch" namespace (the machine's own network is not
  touched); given ``mbit``, a token-bucket filter (``tc ... tbf``) caps each direction of each
  host's link;
- UTS namespace: its own host name (``<prefix><i>``, which does not resolve, as on many
  clusters);
- mount namespace: a private ``/dev/shm`` and a private ``/tmp`` (both empty tmpfs), so that
  shared-memory segments and temporary files of one host are invisible to the others. The paths
  in ``shared`` (a test's directory standing in for NFS), the running Python, phalanx's own
  source and the current directory stay visible at the same paths on every host, even when
  they live under ``/tmp``.

:meth:`Hosts.popen` starts a command on a host (``nsenter`` into the holder's namespaces, in a
new session), :meth:`Hosts.cut` takes a host's link down and :meth:`Hosts.mend` brings it back.
On exit every process started with :meth:`Hosts.popen` is killed with its process group, the
holders end and the namespaces (and their veths and bridge) are deleted.

It needs root, iproute2, ``tc``, ``unshare`` and ``nsenter`` (:func:`unavailable` says why not,
for a skip). This kernel has ``tbf`` but not ``netem``: the link adds bandwidth limits and the
queueing delay they cause, not a fixed propagation delay.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx._check import check_int

__all__ = ["Hosts", "HostsError", "launch_on_hosts", "namespace_hosts", "unavailable"]

TOOLS = ("ip", "tc", "unshare", "nsenter")


class HostsError(RuntimeError):
    """The namespaces, the bridge or the rate limit could not be set up (names the command)."""


@dataclass
class Hosts:
    """``n`` namespace hosts on one bridge: their names, addresses and link rate."""

    names: tuple[str, ...]
    """Each host's host name (its UTS namespace)."""
    ns: tuple[str, ...]
    """Each host's network namespace (``ip netns``)."""
    addr: tuple[str, ...]
    """Each host's address on the bridge."""
    mbit: float | None
    """The cap on each direction of each host's link, in Mbit/s (None: the veth's own speed)."""
    switch: str
    """The namespace holding the bridge."""
    holders: list[subprocess.Popen[str]] = field(default_factory=list, repr=False)
    started: list[subprocess.Popen[str]] = field(default_factory=list, repr=False)

    def command(self, host: int, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """``argv`` run on ``host`` (0-based) in directory ``cwd`` (default: this process's)."""
        target = str(self.holders[host].pid)
        wd = cwd or os.getcwd()
        return ["nsenter", "-t", target, "-u", "-m", "-n", f"--wd={wd}", "--", *argv]

    def popen(
        self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen[str]:
        """Start ``argv`` on ``host`` in a new session (killed with its group on exit), with
        text pipes for stdout and stderr unless ``kw`` says otherwise."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        cwd = kw.pop("cwd", None)
        proc = subprocess.Popen(
            self.command(host, argv, cwd and str(cwd)),
            text=True,
            env=None if env is None else dict(env),
            start_new_session=True,
            **kw,
        )
        self.started.append(proc)
        return proc

    def cut(self, host: int) -> None:
        """Take ``host``'s link down at the bridge: its packets go nowhere until :meth:`mend`."""
        _run("ip", "-n", self.switch, "link", "set", _port(self.ns[host]), "down")

    def mend(self, host: int) -> None:
        """Bring ``host``'s link back up."""
        _run("ip", "-n", self.switch, "link", "set", _port(self.ns[host]), "up")


def _launch_env(drop: Sequence[str]) -> dict[str, str]:
    """This environment for a launcher on a host: phalanx's ``src`` first, one thread per
    worker, no interface pin (each host has its own), less the variables in ``drop``."""
    src = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", *drop)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def launch_on_hosts(
    hosts: Hosts,
    nproc: Sequence[int],
    worker: Sequence[str],
    timeout: float,
    flags: Sequence[str] = (),
    drop_env: Sequence[str] = (),
) -> list[str]:
    """One ``phalanx run`` per host (host ``i`` is node ``i`` with ``nproc[i]`` workers, node 0
    hosts the store) running ``worker`` (what follows the launcher's flags, e.g. ``["-m",
    "module", ...]``); wait for all of them, and return each host's stderr.

    Raises:
        RuntimeError: a host's launcher exited non-zero (its exit code and the end of its
            stderr), or the job took longer than ``timeout`` seconds (then every launcher is
            killed).
    """
    port = str(random.randrange(20000, 30000))
    nodes = ["--nnodes", str(len(nproc)), "--master-addr", hosts.addr[0], "--master-port", port]
    procs = []
    for node, n in enumerate(nproc):
        place = [*nodes, "--node-rank", str(node), "--nproc-per-node", str(n), "--rdzv-timeout"]
        launch = [sys.executable, "-m", "phalanx.launch", *place, "120", *flags]
        procs.append(hosts.popen(node, [*launch, *worker], env=_launch_env(drop_env)))
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for node, p in enumerate(procs):
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"node {node} failed (exit {p.returncode}):\n{err[-3000:]}")
            logs.append(err)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the job did not end within {timeout:.0f} s") from None
    finally:
        for p in procs:
            _kill_group(p)
    return logs


def unavailable() -> str | None:
    """Why :func:`namespace_hosts` cannot work here (not root, a tool missing), or None."""
    if sys.platform != "linux":
        return "needs Linux namespaces"
    if os.geteuid() != 0:
        return "needs root to create namespaces"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    return f"needs {', '.join(missing)} (iproute2, util-linux)" if missing else None


def _run(*argv: str) -> None:
    try:
        subprocess.run(argv, check=True, capture_output=True, text=True, timeout=10)
    except subprocess.CalledProcessError as exc:
        raise HostsError(f"{' '.join(argv)} failed: {exc.stderr.strip()}") from None


def _port(ns: str) -> str:
    """The name of ``ns``'s veth end on the bridge (interface names have at most 15 bytes)."""
    return f"p{ns[-14:]}"


def _tbf(ns: str, dev: str, mbit: float) -> None:
    # a burst of ~2 ms at the rate (at least 16 KiB, a few packets): smooth, not bursty
    burst = max(16 * 1024, int(mbit * 1e6 / 8 * 0.002))
    tbf = ("tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms")
    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)


def _visible(shared: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The paths every host must see where they are: ``shared``, this Python, phalanx's source
    and the current directory (where :meth:`Hosts.popen` runs commands by default), outermost
    first, without ones inside another."""
    import phalanx

    here = Path(phalanx.__file__).resolve().parents[1]
    paths = [*shared, sys.prefix, sys.exec_prefix, here, os.getcwd()]
    resolved = sorted({os.path.realpath(p) for p in paths}, key=len)
    kept: list[str] = []
    for p in resolved:
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return kept


def _holder_script(name: str, carried: list[str]) -> str:
    """Shell run in a new UTS and mount namespace: the host name, a private ``/dev/shm`` and
    ``/tmp``, with each path of ``carried`` (all under ``/tmp``) moved back where it was."""
    lines = ["set -e", f"hostname {name}", "mount -t tmpfs -o mode=1777 tmpfs /dev/shm"]
    if carried:
        lines.append("mount -t tmpfs tmpfs /mnt")
        for i, path in enumerate(carried):
            lines += [f"mkdir /mnt/c{i}", f"mount --bind '{path}' /mnt/c{i}"]
    lines.append("mount -t tmpfs -o mode=1777 tmpfs /tmp")
    for i, path in enumerate(carried):
        lines += [f"mkdir -p '{path}'", f"mount --move /mnt/c{i} '{path}'"]
    if carried:
        lines.append("umount /mnt")
    return "\n".join([*lines, "echo ready", "exec sleep infinity"])


def _start_holder(ns: str, name: str, carried: list[str]) -> subprocess.Popen[str]:
    script = _holder_script(name, carried)
    argv = ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "--propagation", "private"]
    holder = subprocess.Popen(
        [*argv, "--", "sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert holder.stdout is not None
    if holder.stdout.readline().strip() != "ready":
        holder.kill()
        _, err = holder.communicate(timeout=10)
        raise HostsError(f"host {name} ({ns}) could not be set up: {err.strip()}")
    return holder


def _kill_group(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired, ValueError):
        proc.communicate(timeout=10)


@contextmanager
def namespace_hosts(
    n: int = 2,
    mbit: float | None = None,
    shared: Sequence[str | os.PathLike[str]] = (),
    prefix: str = "mh",
) -> Iterator[Hosts]:
    """``n`` namespace hosts on a bridge, each link capped at ``mbit`` Mbit/s each way.

    Args:
        n: how many hosts (2 to 200).
        mbit: the cap on each direction of each host's link; None for none.
        shared: paths every host sees as they are here (a test's directory, as NFS would be).
        prefix: host names are ``<prefix>0``, ``<prefix>1``, ...

    Raises:
        ValueError: ``n``, ``mbit`` or ``prefix`` out of range, naming it and the value.
        HostsError: naming the command that failed (see :func:`unavailable`).
    """
    check_int("n", n, min=2, max=200, where="namespace_hosts")
    if mbit is not None and not (isinstance(mbit, int | float) and mbit > 0):
        raise ValueError(f"namespace_hosts: mbit must be a number > 0 or None, got {mbit!r}")
    if not (isinstance(prefix, str) and prefix.isalnum() and len(prefix) <= 20):
        raise ValueError(f"namespace_hosts: prefix must be 1-20 letters or digits, got {prefix!r}")
    if (why := unavailable()) is not None:
        raise HostsError(why)
    tag = secrets.token_hex(3)
    subnet = f"10.{random.randrange(64, 128)}.{random.randrange(256)}"
    hosts = Hosts(
        names=tuple(f"{prefix}{i}" for i in range(n)),
        ns=tuple(f"phxh{tag}{i}" for i in range(n)),
        addr=tuple(f"{subnet}.{i + 1}" for i in range(n)),
        mbit=mbit,
        switch=f"phxs{tag}",
    )
    carried = [p for p in _visible(shared) if p == "/tmp" or p.startswith("/tmp/")]
    with ExitStack() as cleanup:
        cleanup.callback(_delete, hosts)
        _run("ip", "netns", "add", hosts.switch)
        _run("ip", "-n", hosts.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hosts.switch, "link", "set", "br0", "up")
        for ns, addr, name in zip(hosts.ns, hosts.addr, hosts.names):
            _run("ip", "netns", "add", ns)
            port = _port(ns)
            _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port)
            _run("ip", "-n", ns, "link", "set", port, "netns", hosts.switch)
            _run("ip", "-n", hosts.switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if mbit is not None:
                _tbf(ns, "eth0", mbit)
                _tbf(hosts.switch, port, mbit)
            hosts.holders.append(_start_holder(ns, name, carried))
        yield hosts


def _delete(hosts: Hosts) -> None:
    for proc in [*hosts.started, *hosts.holders]:
        _kill_group(proc)
    for ns in [*hosts.ns, hosts.switch]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
