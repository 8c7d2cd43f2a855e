"""``phalanx.spawn``: ``torch.multiprocessing.spawn`` with a rendezvous store already set up.

The parent hosts a fresh TCPStore on 127.0.0.1 (OS-chosen port, loopback only) and gives each
child the same environment ``phalanx run`` gives its workers, so ``init_process_group("gloo")``
with no ``init_method`` just works inside ``fn``. The first failing child stops all the others;
its traceback comes back as text (exception objects are never pickled).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from phalanx._check import check_bool, check_instance, check_int, check_picklable, check_timeout
from phalanx.comm.netif import GLOO_IFNAME, gloo_interface
from phalanx.launch.nproc import MAX_ENV, nproc_limit
from phalanx.launch.summary import last_exception_line, signal_name

__all__ = ["SpawnContext", "SpawnError", "spawn"]

STOP_GRACE_S = 3.0


class SpawnError(RuntimeError):
    """A spawned process failed or the deadline passed; the message starts ``rank N failed:``."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def _child_entry(
    fn: Callable[..., Any],
    rank: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    conn: Any,
    parent_pid: int,
) -> None:
    """Run ``fn(rank, *args)`` in the child; on an exception send its traceback text and exit 1."""
    from phalanx.launch.workers import die_with_parent

    die_with_parent(parent_pid)()  # die with the parent, even when it is SIGKILLed
    os.environ.update(env)
    try:
        fn(rank, *args)
    except SystemExit:
        raise  # the parent reports the exit code
    except BaseException:
        conn.send(traceback.format_exc())
        conn.close()
        sys.exit(1)
    conn.close()


def _child_env(rank: int, nprocs: int, port: int) -> dict[str, str]:
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    if (iface := gloo_interface(os.environ, "127.0.0.1")) is not None:
        env[GLOO_IFNAME] = iface
    return env


class SpawnContext:
    """Handle on spawned processes (returned by ``spawn(..., join=False)``)."""

    def __init__(
        self, procs: list[Any], conns: list[Any], store: Any, timeout: float | None
    ) -> None:
        self.processes = procs
        self._conns = conns
        self._store = store
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout

    @classmethod
    def start(
        cls,
        ctx: Any,
        nprocs: int,
        target: Callable[..., Any],
        args_of: Callable[[int, Any], tuple[Any, ...]],
        *,
        store: Any = None,
        timeout: float | None = None,
        name: str = "phalanx-rank",
    ) -> SpawnContext:
        """Start ``target(*args_of(rank, writer))`` for each rank in a context ``ctx``.

        ``writer`` is the child's end of a pipe: it sends its traceback there on failure. If
        a start fails, the processes already started are stopped before the error propagates.
        """
        context = cls([], [], store, timeout)
        try:
            for rank in range(nprocs):
                reader, writer = ctx.Pipe(duplex=False)
                context._conns.append(reader)
                proc = ctx.Process(target=target, args=args_of(rank, writer), name=f"{name}-{rank}")
                try:
                    proc.start()
                finally:
                    writer.close()
                context.processes.append(proc)
        except BaseException:
            context._stop()
            raise
        return context

    def pids(self) -> list[int]:
        """Process ids of the children, in rank order."""
        return [int(p.pid) for p in self.processes]

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s (None: until done); True once every child exited with 0.

        Raises:
            SpawnError: a child failed (the others are stopped), or spawn's deadline passed.
        """
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            # Order matters: a child exiting after ``alive`` is taken still wakes the wait below.
            alive = [p for p in self.processes if p.exitcode is None]
            self._check_failures()
            if not alive:
                self._release()
                return True
            now = time.monotonic()
            if self._deadline is not None and now >= self._deadline:
                self._stop()
                raise SpawnError(
                    f"spawn timed out after {self._timeout} s; ranks still running: "
                    f"{[self.processes.index(p) for p in alive]} (all were stopped)"
                )
            if until is not None and now >= until:
                return False
            ends = [t for t in (until, self._deadline) if t is not None]
            wait_s = max(0.0, min(ends) - now) if ends else None
            mpc.wait([p.sentinel for p in alive], timeout=wait_s)

    def _check_failures(self) -> None:
        failed = [(r, p) for r, p in enumerate(self.processes) if p.exitcode not in (None, 0)]
        if not failed:
            return
        rank, proc = failed[0]
        text = self._traceback_of(rank)
        self._stop()
        if text:
            head = last_exception_line(text.splitlines()) or "exception"
            raise SpawnError(f"rank {rank} failed: {head}\n\n{text}", rank)
        code = proc.exitcode
        how = f"killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
        raise SpawnError(f"rank {rank} failed: process {proc.pid} {how}", rank)

    def _traceback_of(self, rank: int) -> str | None:
        conn = self._conns[rank]
        try:
            return str(conn.recv()) if conn.poll(0) else None
        except (EOFError, OSError):
            return None

    def _stop(self) -> None:
        for proc in self.processes:
            if proc.exitcode is None and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        self._release()

    def _release(self) -> None:
        for conn in self._conns:
            conn.close()
        self._store = None


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    timeout: float | None = None,
) -> SpawnContext | None:
    """Run ``fn(i, *args)`` in ``nprocs`` fresh processes (start method ``spawn``).

    Each child finds RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT... set, so
    ``torch.distributed.init_process_group("gloo")`` works without an ``init_method``.

    Args:
        fn: a picklable (module-level) function; receives the rank, then ``args``.
        args: further arguments of ``fn`` (picklable).
        nprocs: number of processes.
        join: wait for the processes and return None; False returns a :class:`SpawnContext`.
        timeout: seconds after which every process is killed and SpawnError raised.

    Raises:
        SpawnError: a child raised (message ``rank N failed: ...`` with its traceback), exited
            non-zero or was killed, or the timeout passed.
    """
    limit, why = nproc_limit(os.environ)
    fn = check_picklable("fn", fn, where="spawn")
    fix = f"the limit here is {limit}: {why}; set {MAX_ENV} to raise it"
    nprocs = check_int("nprocs", nprocs, min=1, where="spawn")
    check_int("nprocs", nprocs, max=limit, where="spawn", fix=fix)
    check_instance("args", args, tuple, "a tuple of further arguments of fn", where="spawn")
    check_bool("join", join, where="spawn")
    if timeout is not None:
        timeout = check_timeout("timeout", timeout, where="spawn").total_seconds()
    from phalanx.comm.store import host_store

    store, port = host_store("127.0.0.1", 0, timedelta(seconds=timeout or 300))
    parent = os.getpid()
    context = SpawnContext.start(
        mp.get_context("spawn"),
        nprocs,
        _child_entry,
        lambda rank, writer: (fn, rank, args, _child_env(rank, nprocs, port), writer, parent),
        store=store,
        timeout=timeout,
    )
    if not join:
        return context
    context.join()
    return None
