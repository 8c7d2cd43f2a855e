"""Process-group initialisation: backend from device, env/tcp/file rendezvous, device binding.

``init_process_group()`` with no arguments reads the launcher's environment (see ``env.py``),
picks NCCL when this local rank has a CUDA device, the shared-memory backend when the launcher
put every (CPU) rank on this machine or (``phalanx run``) 2 or more on every machine, and gloo
otherwise, pins gloo's interface where no launcher did (``GLOO_SOCKET_IFNAME``, as ``phalanx
run`` does), binds the device, and returns a frozen :class:`World`. The store it rendezvouses
through is created here (not by torch) so that the listener binds only the master address, and
so that phalanx can keep a handle on it for collective validation and progress tracking
(handed to the wire's watcher, ``watch.py``: ``phalanx.diagnostics.tracking``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from phalanx._check import check_bool, check_choice, check_int, check_timeout
from phalanx.comm import join, watch
from phalanx.comm.auth import job_secret
from phalanx.comm.backends import BACKENDS, MIN_LOCAL_ENV, auto_backend
from phalanx.comm.env import LaunchEnv, discover_env
from phalanx.comm.flags import tracking_flags
from phalanx.comm.init_method import InitMethod, parse_init_method
from phalanx.comm.netif import GLOO_IFNAME, gloo_interface
from phalanx.comm.rank_zero_first import main_first
from phalanx.comm.signed import SignedStore
from phalanx.comm.store import connect_store, host_store

log = logging.getLogger(__name__)

__all__ = [
    "World",
    "adopt_world",
    "auto_backend",
    "destroy_process_group",
    "fewest_local_ranks",
    "init_process_group",
    "is_initialized",
    "is_main",
    "main_first",
    "pin_gloo_interface",
    "process_group",
    "resolve_backend",
    "signed_store",
    "world",
]

DEFAULT_TIMEOUT = timedelta(seconds=300)
WHERE = "init_process_group"


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
    """The c10d backend in use: gloo, nccl, mpi or shm."""

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


def resolve_backend(
    backend: str | None, local_rank: int, one_machine: bool = False, fewest_local: int = 0
) -> str:
    """Map ``None``/"auto" to nccl when ``cuda:local_rank`` exists, else to shm when
    ``one_machine`` (CPU ranks that all share this machine) or when every machine runs
    ``fewest_local`` >= 2 ranks (hierarchical), else gloo (:func:`auto_backend`); validate
    names."""
    from_env = os.environ.get("PHALANX_BACKEND") if backend is None else None
    if from_env:
        name = from_env.lower()
        if name not in BACKENDS:
            raise ValueError(
                f"environment variable PHALANX_BACKEND={from_env!r} is not one of "
                f"{', '.join(BACKENDS)}; it overrides backend=None: unset it or set a valid name"
            )
    else:
        given = "auto" if backend is None else backend
        name = check_choice("backend", given, BACKENDS, where=WHERE, fold_case=True)
    if name != "auto":
        if name == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs a CUDA device and none is visible; use 'gloo'")
        return name
    gpu = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
    return auto_backend(gpu, one_machine, fewest_local)[0]


def shares_one_machine(env: LaunchEnv, world_size: int) -> bool:
    """Did a launcher say that every rank of this job runs on this machine?

    Only a launcher's ``LOCAL_WORLD_SIZE`` (``phalanx run``, torchrun) counts: ranks started by
    hand with RANK / WORLD_SIZE alone may be anywhere.
    """
    said = "LOCAL_WORLD_SIZE" in os.environ and env.source in ("phalanx", "torchrun")
    return said and world_size > 1 and env.local_world_size == world_size


def fewest_local_ranks(env: LaunchEnv, world_size: int) -> int:
    """The fewest ranks any machine of the job can put on shared memory, as ``phalanx run``
    says (``PHALANX_MIN_LOCAL_WORLD_SIZE``, from its rendezvous); 0 under any other launcher,
    which does not know the other machines' rank counts, or for a world the launcher did not
    make (``world_size=`` other than its ``WORLD_SIZE``)."""
    text = os.environ.get(MIN_LOCAL_ENV)
    if env.source != "phalanx" or text is None or world_size != env.world_size:
        return 0
    if not text.strip().isdigit():
        raise ValueError(
            f"environment variable {MIN_LOCAL_ENV}={text!r} is not a count of ranks (phalanx "
            "run sets it for its workers): unset it"
        )
    return int(text)


def _tcp_store(
    addr: str, port: int, rank: int, joins: bool, agent_store: bool, timeout: timedelta
) -> _Opened:
    where = f"{addr}:{port}"
    if rank == 0 and not agent_store:
        store, _ = host_store(addr, port, timeout)
        return _Opened(store, _Role.HOST, where)
    return _Opened(connect_store(addr, port, timeout), _Role.JOIN if joins else _Role.NONE, where)


def _make_store(
    method: InitMethod, env: LaunchEnv, rank: int, world_size: int, timeout: timedelta
) -> _Opened:
    if method.scheme == "env":
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
    if method.scheme == "tcp":
        assert method.host is not None and method.port is not None
        return _tcp_store(method.host, method.port, rank, True, False, timeout)
    assert method.path is not None
    return _Opened(dist.FileStore(method.path, world_size), _Role.NONE, method.path)


def _rank_and_size(
    method: InitMethod | None, env: LaunchEnv, rank: object, world_size: object
) -> tuple[int, int]:
    """Arguments first, then the init_method's query, then the launcher's environment."""
    given_rank = None if rank is None else check_int("rank", rank, min=0, where=WHERE)
    given_size = None
    if world_size is not None:
        given_size = check_int("world_size", world_size, min=1, where=WHERE)
    query_rank, query_size = (method.rank, method.world_size) if method else (None, None)
    chosen_rank, chosen_size = _first(given_rank, query_rank), _first(given_size, query_size)
    r = env.rank if chosen_rank is None else chosen_rank
    n = env.world_size if chosen_size is None else chosen_size
    if not 0 <= r < n:
        from_env = chosen_rank is None or chosen_size is None
        origin = f", read from the {env.source} environment" if from_env else ""
        raise ValueError(
            f"init_process_group: rank={r} is outside 0..{n - 1} (world_size={n}{origin})"
        )
    return r, n


def _master_host(method: InitMethod | None, env: LaunchEnv) -> str | None:
    """The host every rank reaches to meet (None: a file store, or one process alone)."""
    if method is None or method.scheme == "file":
        return None
    return method.host if method.scheme == "tcp" else env.master_addr


def pin_gloo_interface(master: str | None, rank: int) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` in this process as ``phalanx run`` sets it for its workers.

    torchrun, SLURM and ranks started by hand leave gloo to pick its interface by resolving the
    host name, which falls back to loopback where the name does not resolve: ranks on other
    machines then cannot connect. The interface routing to ``master`` is pinned instead
    (:func:`phalanx.comm.netif.gloo_interface`), never over the user's own value; every gloo
    group this process makes afterwards (the default one, ``new_group``, shm's gloo
    underneath) reads it. Returns the interface pinned, or None.
    """
    name = gloo_interface(os.environ, master)
    if name is not None:
        os.environ[GLOO_IFNAME] = name
        log.info(
            "rank %d: GLOO_SOCKET_IFNAME=%s, the interface that routes to the master %s "
            "(set GLOO_SOCKET_IFNAME to choose another)",
            rank,
            name,
            master,
        )
    return name


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def _join(
    name: str, store: dist.Store, rank: int, world_size: int, limit: timedelta, device: Any
) -> None:
    """torch's rendezvous over ``store``; its bare "wait timeout ... keys" made readable."""
    try:
        dist.init_process_group(
            name, store=store, rank=rank, world_size=world_size, timeout=limit, device_id=device
        )
    except dist.DistStoreError as exc:
        raise TimeoutError(
            f"init_process_group: rank {rank} waited {limit.total_seconds():g} s for the other "
            f"ranks of world_size={world_size} to join, but not all did ({exc}); start every "
            f"rank (e.g. `phalanx run --nproc-per-node {world_size} script.py`) or raise timeout="
        ) from exc


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
        backend: "gloo", "nccl", "mpi", "shm" (shared memory, CPU ranks on one machine: see
            ``phalanx.comm.shm``), or None/"auto": NCCL when this local rank has a CUDA device;
            else shm when a launcher (``phalanx run``, torchrun) put every rank on this
            machine (``LOCAL_WORLD_SIZE`` = ``WORLD_SIZE`` > 1), or when ``phalanx run`` put
            2 or more on every machine (``PHALANX_MIN_LOCAL_WORLD_SIZE`` >= 2: the
            hierarchical group, shared memory inside each machine and gloo between them);
            else gloo.
            ``PHALANX_BACKEND`` (``phalanx run --backend``) overrides None.
        init_method: "env://" (default when MASTER_ADDR is set), "tcp://HOST:PORT" or
            "file:///path". Rank 0 hosts the store for env:// and tcp://, bound only to HOST.
        rank: This process's rank; default from the environment.
        world_size: Number of processes; default from the environment.
        timeout: Collective timeout (seconds or timedelta); default 300 s.
        validate: Compare a fingerprint of every collective across ranks before running it;
            default from ``PHALANX_DEBUG=1``. The tracking flags (``PHALANX_DEBUG``,
            ``PHALANX_MISMATCH_CHECK``, ``PHALANX_CALL_SITES``, ``PHALANX_HANG_TIMEOUT``) are read
            and checked before rendezvous.

    Returns:
        The frozen :class:`World` record.
    """
    global _WORLD, _GENERATION, _SIGNED
    if dist.is_initialized():
        raise RuntimeError(
            "init_process_group() was called twice; call destroy_process_group() first"
        )
    # Every argument is checked before a socket opens or a thread starts.
    method = None if init_method is None else parse_init_method(init_method)
    limit = DEFAULT_TIMEOUT if timeout is None else check_timeout("timeout", timeout, where=WHERE)
    if validate is not None:
        check_bool("validate", validate, where=WHERE)
    flags = tracking_flags()  # a malformed PHALANX_* flag is refused before rendezvous
    env = discover_env()
    rank, world_size = _rank_and_size(method, env, rank, world_size)
    one_machine, fewest = shares_one_machine(env, world_size), fewest_local_ranks(env, world_size)
    name = resolve_backend(backend, env.local_rank, one_machine, fewest)
    if name == "shm" and backend is None and not os.environ.get("PHALANX_BACKEND") and rank == 0:
        why = auto_backend(False, one_machine, fewest)[1]
        log.info("backend shm: %s (backend='gloo' opts out)", why)
    device = torch.device("cpu")
    if name == "nccl":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    store: dist.Store | None = None
    if name == "mpi":
        dist.init_process_group("mpi", timeout=limit)
    else:
        if method is None and (env.master_addr or world_size > 1):
            method = InitMethod("env")
        if world_size > 1:
            pin_gloo_interface(_master_host(method, env), rank)
        if method is None:
            opened = _Opened(dist.HashStore(), _Role.NONE, "a local store")
        else:
            opened = _make_store(method, env, rank, world_size, limit)
        store = opened.store
        if _GENERATION:
            # A process that initialises again (destroy, then init, as hvd.shutdown / hvd.init do)
            # meets the same store: namespace every key by the generation, which every rank
            # counts alike, so that no key of the previous group is read as this one's.
            store = dist.PrefixStore(f"phalanx/generation{_GENERATION}/", store)
        _SIGNED = _job_store(opened, store, rank, env.restart_count, limit)
        _join(name, store, rank, world_size, limit, device if name == "nccl" else None)
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
    checked = flags.debug if validate is None else validate
    watch.start(_SIGNED, rank, world_size, checked, limit, flags)
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


_BEFORE_DESTROY: list[Callable[[], object]] = []


def before_destroy(hook: Callable[[], object]) -> None:
    """Run ``hook`` first in every :func:`destroy_process_group` (registered once).

    For work that still needs the group's store when the user tears it down: an asynchronous
    checkpoint write (``phalanx.checkpoint.wait``) registers itself here.
    """
    if hook not in _BEFORE_DESTROY:
        _BEFORE_DESTROY.append(hook)


def destroy_process_group() -> None:
    """Leave the default process group and stop phalanx's tracking; safe to call twice.

    First runs the :func:`before_destroy` hooks: an asynchronous checkpoint write in flight is
    waited for (and its error raised) before the store it talks through goes away.
    """
    global _WORLD, _SIGNED
    for hook in list(_BEFORE_DESTROY):
        hook()
    watch.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    _WORLD = None
    _SIGNED = None


def adopt_world(record: World | None) -> None:
    """Make ``record`` this process's :func:`world` for a default group built elsewhere.

    Live recovery (``phalanx.recovery.LiveGroup``) builds a new default group for each
    generation, with ranks and a size of its own; the job records each here, so that what asks
    :func:`world` (the progress bar's rank, profiles) follows. None forgets it.
    """
    global _WORLD
    _WORLD = record


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
