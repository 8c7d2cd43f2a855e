"""Run a function on N gloo ranks: the harness behind phalanx's own distributed tests.

``run_distributed(fn, *args, world_size=2)`` starts the ranks from a ``forkserver`` whose preload
list imports torch once (a 2-rank job then costs a fraction of a second, not several seconds),
rendezvouses them through a ``file://`` store in a fresh temporary directory (no ports, no
collisions), calls ``fn(*args)`` on every rank with the default group initialised, and returns the
results by rank. The first rank to fail kills its peers and its traceback is re-raised; one
deadline bounds the whole job.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["DistributedTestError", "run_distributed"]

TEST_BACKEND_ENV = "PHALANX_TEST_BACKEND"
"""The backend of ``run_distributed`` when none is given (default gloo)."""

_CTX: Any = None


class DistributedTestError(RuntimeError):
    """A rank of :func:`run_distributed` failed, died or missed the deadline."""


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "phalanx"])
    return _CTX


def _worker(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    init_method: str,
    options: dict[str, Any],
    conn: multiprocessing.connection.Connection,
) -> None:
    import torch

    import phalanx

    os.environ.update(options["env"])
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
    )
    torch.set_num_threads(1)
    try:
        phalanx.init_process_group(
            options["backend"],
            init_method,
            rank=rank,
            world_size=world_size,
            timeout=options["collective_timeout"],
            validate=options["validate"],
        )
        result = fn(*args)
        conn.send_bytes(b"ok" + pickle.dumps(result))
    except BaseException:
        conn.send_bytes(b"er" + traceback.format_exc().encode())
    finally:
        phalanx.destroy_process_group()
        conn.close()


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 60.0,
    backend: str | None = None,
    collective_timeout: float = 20.0,
    validate: bool = False,
    env: Mapping[str, str] | None = None,
    may_die: Collection[int] = (),
    tcp: bool = False,
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` ranks and return each rank's result, by rank.

    Args:
        fn: A module-level (picklable) function; the default process group is initialised
            when it runs (``phalanx.world()`` tells the rank).
        *args: Picklable arguments passed to ``fn`` on every rank.
        world_size: Number of ranks.
        timeout: Deadline in seconds for the whole job; then every rank is killed.
        backend: c10d backend for the ranks (None: ``PHALANX_TEST_BACKEND``, else gloo; so
            ``PHALANX_TEST_BACKEND=shm pytest ...`` runs a suite's default-backend tests on
            the shared-memory backend).
        collective_timeout: Per-collective timeout in seconds (short, unlike gloo's 30 min).
        validate: Turn on phalanx's cross-rank collective validation.
        env: Extra environment variables for the ranks.
        may_die: Ranks a test kills on purpose: their result is None when they die without one.
        tcp: Rendezvous over a TCPStore on a free loopback port, as ``phalanx run`` does,
            instead of a FileStore in the job's temp dir (whose ``wait`` polls every 10 ms:
            benchmarks of store-driven protocols want the TCP one).

    Raises:
        DistributedTestError: naming the first rank that raised (with its traceback), died, or
            did not finish before the deadline.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="phalanx-test-")
    options = {
        "backend": backend or os.environ.get(TEST_BACKEND_ENV) or "gloo",
        "collective_timeout": collective_timeout,
        "validate": validate,
        # The ranks' per-host files (stacks of stuck or dead ranks) go with the job's temp dir.
        "env": {"PHALANX_RANK_DIR": tmp, **(env or {})},
    }
    init_method = f"file://{os.path.join(tmp, 'store')}"
    if tcp:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(fn, args, rank, world_size, init_method, options, send),
                daemon=True,
                name=f"phalanx-rank-{rank}",
            )
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        return _collect(procs, conns, time.monotonic() + timeout, timeout, set(may_die))
    finally:
        _kill_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(
    procs: list[Any], conns: list[Any], deadline: float, timeout: float, may_die: set[int]
) -> list[Any]:
    results: dict[int, Any] = {}
    pending = dict(enumerate(conns))
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DistributedTestError(
                f"ranks {sorted(pending)} did not finish within the {timeout:.0f} s deadline"
            )
        for conn in multiprocessing.connection.wait(list(pending.values()), timeout=left):
            rank = next(r for r, c in pending.items() if c is conn)
            try:
                msg = conn.recv_bytes()  # type: ignore[union-attr]
            except EOFError:
                del pending[rank]
                procs[rank].join(timeout=2)
                if rank in may_die:
                    results[rank] = None
                    continue
                raise DistributedTestError(
                    f"rank {rank} died without a result (exit code {procs[rank].exitcode})"
                ) from None
            del pending[rank]
            if msg[:2] == b"er":
                raise DistributedTestError(f"rank {rank} failed:\n{msg[2:].decode()}")
            results[rank] = pickle.loads(msg[2:])
    return [results[r] for r in range(len(procs))]
