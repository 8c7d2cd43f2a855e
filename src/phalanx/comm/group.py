"""Process-group initialisation: backend from device, env/tcp/file rendezvous, device binding.

``init_process_group()`` with no arguments reads the launcher's environment (see ``env.py``),
picks NCCL when this local rank has a CUDA device and gloo otherwise, binds the device, and
returns a frozen :class:`World`. The store it rendezvouses through is created here (not by torch)
so that the listener binds only the master address, and so that phalanx can keep a handle on it
for collective validation and progress tracking (``tracking.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist

from phalanx.comm import join, tracking
from phalanx.comm.auth import job_secret
from phalanx.comm.env import LaunchEnv, discover_env
from phalanx.comm.signed import SignedStore
from phalanx.comm.store import connect_store, host_store

__all__ = [
    "World",
    "destroy_process_group",
    "init_process_group",
    "is_initialized",
    "is_main",
    "main_first",
    "process_group",
    "resolve_backend",
    "signed_store",
    "world",
]

DEFAULT_TIMEOUT = timedelta(seconds=300)
BACKENDS = ("auto", "gloo", "nccl", "mpi")


@dataclass(frozen=True)
class World:
    """This process's place in the job, as returned by :func:`init_process_group`."""

    rank: int
    """Global rank, 0..world_size-1."""
    world_size: int
    """Number of processes."""
    local_rank: int
    """Rank on this node; selects the CUDA device."""
    local_world_size: int
    """Processes on this node."""
    node_rank: int
    """Index of this node."""
    device: torch.device
    """The device this rank computes on (``cuda:local_rank`` with NCCL, else ``cpu``)."""
    backend: str
    """The c10d backend in use: gloo, nccl or mpi."""

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0


_WORLD: World | None = None
_SIGNED: SignedStore | None = None
_GENERATION = 0  # process groups this process has initialised so far


class _Role(Enum):
    """This process's part in the join protocol of the store it rendezvouses through."""

    HOST = "host"  # it hosts the store: it writes the join record
    JOIN = "join"  # a phalanx host wrote a join record: verify it, prove the secret
    NONE = "none"  # file://, a single process, or a store hosted by torchrun / phalanx.spawn


@dataclass(frozen=True)
class _Opened:
    store: dist.Store
    role: _Role
    where: str


def resolve_backend(backend: str | None, local_rank: int) -> str:
    """Map ``None``/"auto" to nccl when ``cuda:local_rank`` exists, else gloo; validate names."""
    name = (backend or os.environ.get("PHALANX_BACKEND") or "auto").lower()
    if name not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if name != "auto":
        if name == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs a CUDA device and none is visible; use 'gloo'")
        return name
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        return "nccl"
    return "gloo"


def _as_timedelta(timeout: timedelta | float | None) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        return timeout
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    return timedelta(seconds=float(timeout))


def _tcp_store(
    addr: str, port: int, rank: int, joins: bool, agent_store: bool, timeout: timedelta
) -> _Opened:
    where = f"{addr}:{port}"
    if rank == 0 and not agent_store:
        store, _ = host_store(addr, port, timeout)
        return _Opened(store, _Role.HOST, where)
    return _Opened(connect_store(addr, port, timeout), _Role.JOIN if joins else _Role.NONE, where)


def _make_store(
    init_method: str, env: LaunchEnv, rank: int, world_size: int, timeout: timedelta
) -> _Opened:
    url = urlparse(init_method)
    if url.scheme == "env":
        if env.master_addr is None:
            raise ValueError(
                "init_method='env://' needs MASTER_ADDR (and MASTER_PORT) in the environment; "
                "launch with `phalanx run` or set them"
            )
        # Under `phalanx run` the launcher hosts a fresh store per restart generation (so no
        # stale keys survive a restart) and every rank connects as a client. torchrun's and
        # phalanx.spawn's hosts write no join record; phalanx run's and rank 0's do.
        joins = not env.agent_store or env.source == "phalanx"
        return _tcp_store(env.master_addr, env.master_port, rank, joins, env.agent_store, timeout)
    if url.scheme == "tcp":
        if url.hostname is None or url.port is None:
            raise ValueError(f"init_method={init_method!r} must look like tcp://HOST:PORT")
        return _tcp_store(url.hostname, url.port, rank, True, False, timeout)
    if url.scheme == "file":
        path = url.path or url.netloc
        if not path:
            raise ValueError(f"init_method={init_method!r} must look like file:///path/to/file")
        return _Opened(dist.FileStore(path, world_size), _Role.NONE, path)
    raise ValueError(f"init_method={init_method!r}: scheme must be env://, tcp:// or file://")


def _rank_and_size(
    init_method: str | None, env: LaunchEnv, rank: int | None, world_size: int | None
) -> tuple[int, int]:
    if init_method is not None:
        query = parse_qs(urlparse(init_method).query)
        rank = int(query["rank"][0]) if rank is None and "rank" in query else rank
        if world_size is None and "world_size" in query:
            world_size = int(query["world_size"][0])
    rank = env.rank if rank is None else rank
    world_size = env.world_size if world_size is None else world_size
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1} (world_size={world_size})")
    return rank, world_size


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: timedelta | float | None = None,
    validate: bool | None = None,
) -> World:
    """Join the job's default process group and return this process's :class:`World`.

    Args:
        backend: "gloo", "nccl", "mpi", or None/"auto" (NCCL when this local rank has a CUDA
            device, else gloo). ``PHALANX_BACKEND`` overrides None.
        init_method: "env://" (default when MASTER_ADDR is set), "tcp://HOST:PORT" or
            "file:///path". Rank 0 hosts the store for env:// and tcp://, bound only to HOST.
        rank: This process's rank; default from the environment.
        world_size: Number of processes; default from the environment.
        timeout: Collective timeout (seconds or timedelta); default 300 s.
        validate: Compare a fingerprint of every collective across ranks before running it;
            default from ``PHALANX_DEBUG=1``.

    Returns:
        The frozen :class:`World` record.
    """
    global _WORLD, _GENERATION, _SIGNED
    if dist.is_initialized():
        raise RuntimeError(
            "init_process_group() was called twice; call destroy_process_group() first"
        )
    env = discover_env()
    rank, world_size = _rank_and_size(init_method, env, rank, world_size)
    name = resolve_backend(backend, env.local_rank)
    limit = _as_timedelta(timeout)
    device = torch.device("cpu")
    if name == "nccl":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    store: dist.Store | None = None
    if name == "mpi":
        dist.init_process_group("mpi", timeout=limit)
    else:
        if init_method is None:
            init_method = "env://" if env.master_addr or world_size > 1 else None
        if init_method is None:
            opened = _Opened(dist.HashStore(), _Role.NONE, "a local store")
        else:
            opened = _make_store(init_method, env, rank, world_size, limit)
        store = opened.store
        if _GENERATION:
            # A process that initialises again (destroy, then init, as hvd.shutdown / hvd.init do)
            # meets the same store: namespace every key by the generation, which every rank
            # counts alike, so that no key of the previous group is read as this one's.
            store = dist.PrefixStore(f"phalanx/generation{_GENERATION}/", store)
        _SIGNED = _job_store(opened, store, rank, env.restart_count, limit)
        dist.init_process_group(
            name,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=limit,
            device_id=device if name == "nccl" else None,
        )
    _GENERATION += 1
    _WORLD = World(
        rank=rank,
        world_size=world_size,
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        node_rank=env.node_rank,
        device=device,
        backend=name,
    )
    debug = os.environ.get("PHALANX_DEBUG", "") not in ("", "0")
    tracking.start(_SIGNED, rank, world_size, debug if validate is None else validate, limit)
    return _WORLD


def _run_id() -> str:
    return os.environ.get("PHALANX_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""


def _job_store(
    opened: _Opened, store: dist.Store, rank: int, restart: int, timeout: timedelta
) -> SignedStore:
    """Join the job (host it, or prove the secret to its host); sign under its scope."""
    secret, run_id = job_secret(), _run_id()
    if opened.role is _Role.HOST:
        scope = join.host_job(opened.store, secret, run_id, restart, opened.where)
    elif opened.role is _Role.JOIN:
        scope = join.join_job(opened.store, secret, rank, run_id, restart, opened.where, timeout)
    else:
        scope = f"{run_id}/{restart}"
    signed = SignedStore(store, secret, f"{scope}/{_GENERATION}")
    if opened.role is not _Role.NONE:
        join.prove(signed, rank)
    return signed


def signed_store() -> SignedStore | None:
    """The signer of phalanx's values in the default group's store (None without a group).

    After torch's own ``init_process_group`` it signs over torch's default store, with the
    secret and run id of the environment.
    """
    if _SIGNED is not None:
        return _SIGNED
    if not (dist.is_available() and dist.is_initialized()):
        return None
    scope = f"{_run_id()}/{discover_env().restart_count}/torch"
    return SignedStore(dist.distributed_c10d._get_default_store(), job_secret(), scope)


def destroy_process_group() -> None:
    """Leave the default process group and stop phalanx's tracking; safe to call twice."""
    global _WORLD, _SIGNED
    tracking.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    _WORLD = None
    _SIGNED = None


def is_initialized() -> bool:
    """True between :func:`init_process_group` and :func:`destroy_process_group`."""
    return _WORLD is not None and dist.is_initialized()


def world() -> World:
    """The current :class:`World`; a single-process world when no group was initialised."""
    if _WORLD is not None:
        return _WORLD
    return World(0, 1, 0, 1, 0, torch.device("cpu"), "none")


def is_main() -> bool:
    """True on global rank 0, and in a single process."""
    return world().rank == 0


@contextlib.contextmanager
def process_group(
    backend: str | None = None, init_method: str | None = None, **kwargs: object
) -> Iterator[World]:
    """Context-manager form: ``with phalanx.process_group() as w: ...`` destroys on exit."""
    w = init_process_group(backend, init_method, **kwargs)  # type: ignore[arg-type]
    try:
        yield w
    finally:
        destroy_process_group()


@contextlib.contextmanager
def main_first(group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Rank 0 runs the block first; the others wait, then run it (seed 004's barrier pattern).

    Typical use: download or preprocess a data set once, then let every rank read the cache.
    Without an initialised group the block simply runs.
    """
    if not dist.is_initialized():
        yield
        return
    first = dist.get_rank(group) == 0
    if not first:
        dist.barrier(group)
    try:
        yield
    finally:
        if first:
            dist.barrier(group)
