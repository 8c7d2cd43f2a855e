"""Per-host files that outlive a stuck or dead rank: its Python stacks and its last calls.

A rank that holds the GIL in native code cannot answer a hang report, and a rank that gloo
aborts cannot say where it was. ``faulthandler`` writes Python stacks from C, without the
GIL, so each rank keeps three files in one directory per host and job,
``$PHALANX_RANK_DIR`` (default: the system temp dir) ``/phalanx-<uid>-<token>/``:

- ``rank-<r>.fatal``: ``faulthandler.enable``: every thread's stack at a fatal signal
  (SIGABRT from gloo, SIGSEGV).
- ``rank-<r>.stuck``: ``faulthandler.dump_traceback_later``, re-armed every ``STUCK_S / 4``
  seconds by a thread of its own that does nothing else (:meth:`RankFiles.rearm`): a dump
  appears only once that thread could not take the GIL for ``STUCK_S`` seconds (the GIL held
  in native code, when the stacks stand still) and is emptied when it runs again. The
  progress thread cannot do this: a slow store call would let the dump fire while the main
  thread runs Python, and faulthandler reading a running thread's frames can crash the
  process (measured: a segfault in 1 of 3 runs of a loop of 800,000 calls).
- ``rank-<r>.calls``: the ring of the last collective calls (:mod:`.call_ring`).

The token is agreed through the store; each rank publishes ``who/<r>`` (host, the address it
reaches the master from, machine, pid, directory, main thread id) so a reporter knows whether it
can read a peer's files, says where they are when it cannot (``HOST:PATH``), and names the
other machine when a peer there may be cut off by the network. A clean exit removes the files;
after a crash they stay as evidence (``phalanx.testing.run_distributed`` points
``PHALANX_RANK_DIR`` into its own temporary directory). A forked child (a DataLoader worker)
stops writing into them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import re
import secrets
import socket
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from phalanx.comm.netif import local_ip_for
from phalanx.comm.signed import SignedStore
from phalanx.diagnostics.call_ring import CallRing, read_calls
from phalanx.diagnostics.flight import Record

__all__ = ["Peer", "RankFiles", "fatal_signal", "open_rank_files", "peers", "thread_stack"]

STUCK_S = 1.0
"""This long without the re-arming thread getting the GIL writes a stuck dump."""
SIGNALS = {
    "Aborted": "SIGABRT",
    "Segmentation fault": "SIGSEGV",
    "Floating-point exception": "SIGFPE",
    "Bus error": "SIGBUS",
    "Illegal instruction": "SIGILL",
}
log = logging.getLogger(__name__)
_CURRENT: RankFiles | None = None
_FORK_HOOK = False


def _private_dir(path: Path) -> None:
    """Create ``path`` (0700) or accept it only if it is our own directory, not a link."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise OSError(f"{path} exists and is not a directory of this user") from None


def _private_file(path: Path) -> BinaryIO:
    """``path`` opened for writing (0600, truncated); kept open for faulthandler."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    return os.fdopen(fd, "wb")


class RankFiles:
    """This rank's files: the fatal-signal stack, the stuck-thread stack, the call ring."""

    def __init__(self, directory: Path, rank: int) -> None:
        global _CURRENT
        self.dir, self.rank = directory, rank
        self._owner = os.getpid()
        self.ring = CallRing(self.path("calls"))
        self._fatal = _private_file(self.path("fatal"))
        self._stuck = _private_file(self.path("stuck"))
        self._was_enabled = faulthandler.is_enabled()
        faulthandler.enable(self._fatal, all_threads=True)
        _install_fork_hooks()
        _CURRENT = self
        self.rearm()
        self._stop = threading.Event()
        self._keeper = threading.Thread(target=self._keep_armed, name="phalanx-stacks", daemon=True)
        self._keeper.start()

    def path(self, kind: str) -> Path:
        """``DIR/rank-<r>.<kind>``."""
        return self.dir / f"rank-{self.rank}.{kind}"

    def rearm(self) -> None:
        """Push the stuck dump ``STUCK_S`` into the future; empty a dump written meanwhile."""
        with _ARMING:
            self._arm()

    def _keep_armed(self) -> None:
        while not self._stop.wait(STUCK_S / 4):
            try:
                self.rearm()
            except (OSError, ValueError):  # the files were closed meanwhile
                return

    def _arm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        fd = self._stuck.fileno()
        if os.fstat(fd).st_size:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
        faulthandler.dump_traceback_later(STUCK_S, file=self._stuck)

    def _release_faulthandler(self) -> None:
        faulthandler.disable()
        if self._was_enabled:  # the previous stderr handler; stderr may have no file (Jupyter)
            with contextlib.suppress(AttributeError, OSError, RuntimeError, ValueError):
                faulthandler.enable()

    def close(self) -> None:
        """Stop faulthandler (restoring a previous stderr handler) and delete the files.

        Only in the process that opened them: a forked child that exits leaves them alone.
        """
        global _CURRENT
        if os.getpid() != self._owner:
            return
        self._stop.set()
        if self._keeper is not threading.current_thread():
            self._keeper.join(timeout=5)
        with _ARMING:
            faulthandler.cancel_dump_traceback_later()
        self._release_faulthandler()
        if _CURRENT is self:
            _CURRENT = None
        self.ring.close()
        for f in (self._fatal, self._stuck):
            f.close()
        for kind in ("calls", "fatal", "stuck"):
            self.path(kind).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.dir.rmdir()  # the last rank of this host to leave removes it


_ARMING = threading.Lock()
"""Held while the stuck dump is (re-)armed, and across a fork (see :func:`_install_fork_hooks`)."""


def _install_fork_hooks() -> None:
    """Make ``fork()`` safe while the stuck dump is armed.

    A child forked while faulthandler's watchdog thread waits would itself wait forever for that
    thread (it does not exist in the child) as soon as the dump is cancelled or re-armed there,
    so a DataLoader worker would hang at its start. The dump is therefore cancelled just before
    the fork and re-armed in the parent just after; the child only lets go of faulthandler.
    """
    global _FORK_HOOK
    if not _FORK_HOOK:
        os.register_at_fork(
            before=_before_fork,
            after_in_parent=_after_fork_in_parent,
            after_in_child=_after_fork_in_child,
        )
        _FORK_HOOK = True


def _before_fork() -> None:
    _ARMING.acquire()
    if _CURRENT is not None:
        faulthandler.cancel_dump_traceback_later()


def _after_fork_in_parent() -> None:
    try:
        if _CURRENT is not None:
            _CURRENT._arm()
    finally:
        _ARMING.release()


def _after_fork_in_child() -> None:
    global _CURRENT
    _ARMING.release()
    files, _CURRENT = _CURRENT, None
    if files is not None:
        files._release_faulthandler()


def _token(value: Any) -> str:
    if not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{16}", value)):
        raise TypeError("a directory token is 16 hex digits")
    return value


def open_rank_files(store: SignedStore, rank: int) -> RankFiles | None:
    """Open this rank's files in the job's directory and publish ``who/<rank>``."""
    token = store.first("files/token", secrets.token_hex(8), _token)
    base = Path(os.environ.get("PHALANX_RANK_DIR") or tempfile.gettempdir())
    directory = base / f"phalanx-{os.getuid()}-{token}"
    files: RankFiles | None
    try:
        _private_dir(directory)
        files = RankFiles(directory, rank)
    except OSError as exc:
        log.warning(
            "rank %d: no per-rank files in %s (%s): hang reports and failures will lack the "
            "stacks of stuck or dead ranks; set PHALANX_RANK_DIR to a writable directory",
            rank,
            directory,
            exc,
        )
        files = None
    who = {
        "host": socket.gethostname(),
        "addr": _address(),
        "machine": machine_id(),
        "pid": os.getpid(),
        "dir": "" if files is None else str(directory),
        "main": threading.main_thread().ident or 0,
    }
    store.put(f"who/{rank}", who)
    return files


def _address() -> str:
    """The address this rank reaches the master from ("" when there is no MASTER_ADDR or no
    route): what a reporter on another host names, so the link to this one can be checked."""
    master = os.environ.get("MASTER_ADDR")
    return (local_ip_for(master) or "") if master else ""


def machine_id() -> str:
    """What tells this machine and PID namespace apart from another with the same host name.

    Containers sharing a host name (host networking) have their own ``/tmp`` and PIDs: a peer's
    files and ``kill(pid, 0)`` only mean something with the same boot id and PID namespace.
    """
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(path) if path.endswith("ns/pid") else Path(path).read_text())
        except OSError:
            parts.append("?")
    return "/".join(p.strip() for p in parts)


def fatal_signal(text: str) -> str | None:
    """The signal named by faulthandler's ``Fatal Python error: Aborted`` header, if any."""
    m = re.search(r"Fatal Python error: ([A-Za-z -]+)", text)
    return None if m is None else SIGNALS.get(m.group(1).strip(), m.group(1).strip())


def thread_stack(text: str, thread: int) -> list[str]:
    """The frames (most recent call first) of ``thread`` in a faulthandler dump.

    Falls back to every frame of the dump when the thread is not found.
    """
    blocks = re.split(r"\n\s*(?=(?:Current thread|Thread) 0x)", text)
    for block in blocks:
        m = re.match(r"\s*(?:Current thread|Thread) (0x[0-9a-f]+)", block)
        if m and int(m.group(1), 16) == thread:
            return _frames(block)
    return _frames(text)


def _frames(text: str) -> list[str]:
    keep = ("File ", "<no Python frame>")
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith(keep)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (dead, not yet reaped by its parent) still answers kill(0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


@dataclass(frozen=True)
class Peer:
    """Another rank as it published itself, and what its files (on this host) say."""

    rank: int
    host: str
    pid: int
    dir: str
    main: int
    machine: str = ""
    """:func:`machine_id` of its machine ("" when it did not say)."""
    addr: str = ""
    """The address it reaches the master from ("" when it did not say)."""

    def here(self) -> bool:
        """True when this process can read the peer's files: same host name, machine and PID
        namespace, and its ring file present."""
        same = self.host == socket.gethostname() and self.machine in ("", machine_id())
        return same and bool(self.dir) and self.file("calls").exists()

    def elsewhere(self) -> bool:
        """True when it runs on another machine than this process: another host name, or
        another boot of the kernel (the first part of :func:`machine_id`), where it said."""
        boot = self.machine.split("/")[0]
        return self.host != socket.gethostname() or boot not in ("", machine_id().split("/")[0])

    def file(self, kind: str) -> Path:
        """Its ``rank-<r>.<kind>`` file."""
        return Path(self.dir) / f"rank-{self.rank}.{kind}"

    def where(self, kind: str) -> str:
        """``HOST:PATH`` of its ``kind`` file, for a reader on another host."""
        return f"{self.host}:{self.file(kind)}"

    def alive(self) -> bool | None:
        """Whether its process lives (None: on another host, unknown from here)."""
        return _alive(self.pid) if self.here() else None

    def _read(self, kind: str) -> str:
        try:
            return self.file(kind).read_text(errors="replace") if self.here() else ""
        except OSError:
            return ""

    def death(self) -> tuple[str | None, list[str]] | None:
        """(signal, main thread stack) from its fatal-signal file; None if it has none."""
        text = self._read("fatal")
        return None if not text.strip() else (fatal_signal(text), thread_stack(text, self.main))

    def stuck(self) -> list[str] | None:
        """Its main thread's stack from a stuck dump it has now; None if none."""
        stack = thread_stack(self._read("stuck"), self.main)
        return stack or None  # nothing yet, or faulthandler is still writing its first lines

    def calls(self) -> list[Record] | None:
        """Its last calls from its ring file; None when not readable from here."""
        return read_calls(self.file("calls")) if self.here() else None


def _who(value: Any) -> dict[str, Any]:
    ok = isinstance(value, dict) and isinstance(value.get("host"), str)
    if not ok or not all(isinstance(value.get(k), int) for k in ("pid", "main")):
        raise TypeError("who is {host, pid, dir, main}")
    if not isinstance(value.get("dir"), str):
        raise TypeError("who.dir is a string")
    return value


def peers(store: SignedStore, ranks: list[int]) -> dict[int, Peer]:
    """The ranks among ``ranks`` that published ``who/<r>``."""
    out = {}
    for r in ranks:
        who = store.get(f"who/{r}", _who)
        if who is not None:
            machine, addr = who.get("machine"), who.get("addr")
            out[r] = Peer(
                r,
                who["host"],
                who["pid"],
                who["dir"],
                who["main"],
                machine if isinstance(machine, str) else "",
                addr if isinstance(addr, str) else "",
            )
    return out
