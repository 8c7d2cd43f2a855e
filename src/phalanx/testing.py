"""Run a function on N gloo ranks: the harness behind phalanx's own distributed tests.

``run_distributed(fn, *args, world_size=2)`` starts the ranks from a ``forkserver`` whose preload
list (``_PRELOAD``) imports torch and phalanx once (a 2-rank job then costs a fraction of a
second, not several seconds),
rendezvouses them through a ``file://`` store in a fresh temporary directory (no ports, no
collisions), calls ``fn(*args)`` on every rank with the default group initialised, and returns the
results by rank. The first rank to fail kills its peers and its traceback is re-raised; one
deadline bounds the whole job.

Deadlines are given in seconds *of an idle machine* and stretched by :func:`slowness`, the measured
share of a CPU this process gets now: a test that takes 2 s alone takes 6 s beside four CPU
burners on two cores, and must not fail for it. :func:`scaled` applies the same factor to any
other limit (a subprocess's timeout, a "this answered promptly" assertion).
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

__all__ = ["DistributedTestError", "run_distributed", "scaled", "slowness"]

_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "phalanx.comm.group",
    "phalanx.diagnostics.tracking",
    "phalanx.train",
)
"""What the forkserver imports once for every rank it forks: torch (and the ``torch._dynamo`` that
a first optimizer imports), the wire and its diagnostics, and the job API. 8 two-rank jobs of one
``Job`` step took 2.9-3.0 s with these, 3.7-4.0 s with torch's three alone (2-core machine)."""

TEST_BACKEND_ENV = "PHALANX_TEST_BACKEND"
"""The backend of ``run_distributed`` when none is given (default gloo)."""

SLOWNESS_ENV = "PHALANX_TEST_SLOWNESS"
"""Fixes :func:`slowness` to this factor (e.g. ``1`` turns the stretching off)."""
MAX_SLOWNESS = 10.0
_PROBE_CPU_S = 0.02  # CPU time the probe spins for: a few scheduler slices of a loaded machine
_PROBE_CACHE_S = 5.0

_CTX: Any = None
_probed: tuple[float, float] = (-_PROBE_CACHE_S, 1.0)  # (when, factor)


def slowness(*, fresh: bool = False) -> float:
    """How many times slower than on an idle machine this process runs now, from 1 to 10.

    Measured, not guessed: the wall time a busy loop takes per second of this process's CPU
    time (the median of three 7 ms probes; 1.0 when the process gets a whole CPU, about 3 to 5
    beside four CPU burners on two cores), or the 1-minute load average per CPU if that is
    higher (it also counts bursts the probe did not meet). Cached for 5 s unless ``fresh``;
    ``PHALANX_TEST_SLOWNESS`` fixes it.
    """
    global _probed
    fixed = os.environ.get(SLOWNESS_ENV)
    if fixed:
        try:
            return min(max(float(fixed), 1.0), MAX_SLOWNESS)
        except ValueError:
            raise ValueError(f"{SLOWNESS_ENV}={fixed!r} is not a number (e.g. 1 or 2.5)") from None
    when, factor = _probed
    if fresh or time.monotonic() - when > _PROBE_CACHE_S:
        spun = sorted(_spin(_PROBE_CPU_S / 3) for _ in range(3))[1]  # the median of three
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
        factor = min(max(spun, load, 1.0), MAX_SLOWNESS)
        _probed = (time.monotonic(), factor)
    return factor


def _spin(cpu_s: float) -> float:
    """Wall time over CPU time of a busy loop that runs for ``cpu_s`` of CPU (at most 1 s)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while time.process_time() - cpu0 < cpu_s and time.perf_counter() - wall0 < 1.0:
        pass
    return (time.perf_counter() - wall0) / max(time.process_time() - cpu0, 1e-6)


def scaled(seconds: float) -> float:
    """``seconds`` on an idle machine, stretched by the :func:`slowness` of this one now."""
    return seconds * slowness()


class _Deadline:
    """A limit of ``seconds`` on an idle machine, stretched by :func:`slowness`. When it seems
    spent, the slowness is measured again: load that rose meanwhile extends it."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start, self.factor = seconds, time.monotonic(), slowness()

    def left(self) -> float:
        left = self.start + self.seconds * self.factor - time.monotonic()
        if left <= 0 and self.factor < MAX_SLOWNESS:
            factor = slowness(fresh=True)
            if factor > self.factor:
                self.factor = factor
                return self.left()
        return left


class DistributedTestError(RuntimeError):
    """A rank of :func:`run_distributed` failed, died or missed the deadline."""


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(list(_PRELOAD))
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
    per_node = world_size // options["nodes"]
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node),
    )
    if options["nodes"] > 1:  # shm tells machines apart by this name
        os.environ["PHALANX_SHM_HOST"] = f"{options['tmp']}-node{rank // per_node}"
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
    nodes: int = 1,
    children: bool = False,
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` ranks and return each rank's result, by rank.

    Args:
        fn: A module-level (picklable) function; the default process group is initialised
            when it runs (``phalanx.world()`` tells the rank).
        *args: Picklable arguments passed to ``fn`` on every rank.
        world_size: Number of ranks.
        timeout: Deadline in seconds for the whole job on an idle machine, stretched by
            :func:`slowness`; then every rank is killed.
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
        nodes: Pretend the ranks run on this many machines, as a launcher lays them out:
            ``world_size / nodes`` consecutive ranks per node, with ``LOCAL_RANK``,
            ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` (``phalanx.world().node_rank``) set so,
            and ``PHALANX_SHM_HOST`` naming each node (a ``backend="shm"`` group that spans
            nodes is then hierarchical, as across machines). Must divide ``world_size``.
        children: The ranks may start processes of their own (torch DCP's writer process):
            they are then not daemonic. Either way they are killed when the call returns.

    Raises:
        DistributedTestError: naming the first rank that raised (with its traceback), died, or
            did not finish before the deadline.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not (isinstance(nodes, int) and nodes >= 1 and world_size % nodes == 0):
        raise ValueError(
            f"run_distributed(nodes={nodes!r}): nodes must be an int >= 1 that divides "
            f"world_size={world_size}"
        )
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="phalanx-test-")
    options = {
        "backend": backend or os.environ.get(TEST_BACKEND_ENV) or "gloo",
        "collective_timeout": collective_timeout,
        "validate": validate,
        "nodes": nodes,
        "tmp": tmp,
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
                daemon=not children,
                name=f"phalanx-rank-{rank}",
            )
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        return _collect(procs, conns, _Deadline(timeout), set(may_die))
    finally:
        _kill_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(
    procs: list[Any], conns: list[Any], deadline: _Deadline, may_die: set[int]
) -> list[Any]:
    results: dict[int, Any] = {}
    pending = dict(enumerate(conns))
    while pending:
        left = deadline.left()
        if left <= 0:
            raise DistributedTestError(
                f"ranks {sorted(pending)} did not finish within the {deadline.seconds:.0f} s "
                f"deadline (x{deadline.factor:.1f} for this machine's measured slowness)"
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
