"""A shared-memory segment that every rank of a group maps, that no stranger can redirect, and
that nobody leaves behind.

The ranks first *meet* through the group's store: each says where it runs (pid, process start,
host) and draws a random nonce. Rank 0 then makes the segment (``segment_file.py``: a memfd
where it can see every peer's process, so that the segment never has a name in ``/dev/shm``;
else a file there) and publishes a :class:`~phalanx.comm.shm.segment_file.Handle` to it, with
every rank's nonce. Each peer opens and checks the file, maps it, and says so; rank 0 closes
its descriptor (and unlinks a named file) once every rank has said so.

Every record is signed with the job secret (``comm/signed.py``): a process without
``PHALANX_JOB_SECRET`` that writes these keys is ignored (its value is logged and skipped), and
a signed record replayed from another group carries other nonces and is refused. Without a
secret the records are framed and checked all the same (junk is refused), but not
authenticated. No counter decides anything: rank 0, the creator, alone closes and unlinks, after
every rank's own signed record.

When rank 0 cannot make the segment (``/dev/shm`` too small), it publishes the reason, and every
peer raises it at once instead of waiting out the group's timeout. A peer that cannot open it
does the same towards rank 0.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from phalanx.comm.auth import job_secret
from phalanx.comm.shm.segment_file import (
    SEGMENT_PREFIX,
    SHM_DIR,
    Handle,
    SegmentError,
    close_created,
    create,
    open_handle,
    shm_path,
)
from phalanx.comm.shm.sync import process_start
from phalanx.comm.signed import Rejected, SignedStore, as_record

__all__ = [
    "HOST_ENV",
    "SEGMENT_KEY",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "Meeting",
    "check_one_host",
    "host_identity",
    "meet",
    "open_segment",
    "signer",
]

HOST_ENV = "PHALANX_SHM_HOST"
_KEY = "phalanx_shm/"
SEGMENT_KEY = _KEY
"""The prefix of the group's own segment's records."""
_POLL_S = 0.02
T = TypeVar("T")


def host_identity() -> str:
    """The machine this process runs on, as far as ``/dev/shm`` goes: ``PHALANX_SHM_HOST`` if
    set (to tell apart containers that repeat a hostname, or to split one machine in tests),
    else the hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def signer(store: dist.Store) -> SignedStore:
    """Signed values over a group's store: under the job's scope where phalanx made the default
    group, else under the run id and restart of the environment (torch's own init)."""
    from phalanx.comm.env import discover_env
    from phalanx.comm.group import signed_store

    job = signed_store()
    if job is not None:
        return SignedStore(store, job.secret, job.scope)
    run_id = os.environ.get("PHALANX_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""
    return SignedStore(store, job_secret(), f"{run_id}/{discover_env().restart_count}/shm")


@dataclass(frozen=True)
class _Arrival:
    pid: int
    start: int
    host: str
    nonce: str


@dataclass(frozen=True)
class _Mapped:
    nonce: str
    error: str


@dataclass(frozen=True)
class _Made:
    nonces: list[str]
    handle: dict[str, Any] | None
    error: str


def _wait_valid(
    signed: SignedStore,
    key: str,
    deadline: float,
    parse: Callable[[Any], T],
    check: Callable[[T], bool],
) -> T:
    """The first signed value at ``key`` that ``check`` accepts; forged or replayed ones are
    skipped (logged once). Raises ``TimeoutError`` naming a forgery when one was all there was."""
    seen_bad = ""
    while True:
        raw = signed.raw(key)
        if raw is not None:
            try:
                value = signed.decode(key, raw, parse)
                if check(value):
                    return value
                seen_bad = "a signed record of another group (replayed)"
            except Rejected as why:
                signed.accept(key, raw, parse)  # logs it once
                seen_bad = f"a value this job did not write ({why})"
        if time.monotonic() >= deadline:
            where = f"store key {signed.prefix + key!r}"
            raise TimeoutError(
                f"{where} holds {seen_bad}: a process without this job's PHALANX_JOB_SECRET "
                "wrote into the store (see docs/security.md)"
                if seen_bad
                else f"no value at {where}"
            )
        if raw is None:
            left = timedelta(seconds=max(0.001, deadline - time.monotonic()))
            with contextlib.suppress(RuntimeError):  # timed out: said above on the next round
                signed.wait_exists([key], left)
        else:
            time.sleep(_POLL_S)


@dataclass(frozen=True)
class Meeting:
    """Where the ranks of a group run."""

    hosts: list[str]
    """Each rank's host."""
    processes: list[tuple[int, int]] | None
    """Each rank's (pid, process start time); None when this process cannot see them all
    (another pid namespace): then a dead peer is found by the timeout only."""
    nonces: list[str]
    """Each rank's random nonce for this group (binds the segment's record to the group)."""
    rank: int = 0
    """This process's rank in the group."""

    @property
    def one_host(self) -> bool:
        return len(set(self.hosts)) == 1


def meet(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Meeting:
    """Every rank's host (:func:`host_identity`), process and nonce, through signed records."""
    signed = signer(store).sub(_KEY)
    pid = os.getpid()
    mine = _Arrival(pid, process_start(pid) or 0, host_identity(), secrets.token_hex(16))
    signed.put(f"host/{rank}", mine.__dict__)
    deadline = time.monotonic() + timeout.total_seconds()
    parse = lambda v: as_record(_Arrival, v)  # noqa: E731
    every = [
        mine if r == rank else _wait_valid(signed, f"host/{r}", deadline, parse, lambda a: True)
        for r in range(world_size)
    ]
    processes = [(a.pid, a.start) for a in every]
    visible = all(process_start(p) == start for p, start in processes)
    return Meeting(
        [a.host for a in every], processes if visible else None, [a.nonce for a in every], rank
    )


def check_one_host(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Meeting:
    """:func:`meet`, raising when the ranks of the group are not all on this machine."""
    met = meet(store, rank, world_size, timeout)
    if not met.one_host:
        where = ", ".join(f"rank {r} on {h}" for r, h in enumerate(met.hosts))
        raise ValueError(
            f"an shm segment needs every rank of the group on one machine, but {where}; "
            f"set {HOST_ENV} alike where one machine has several hostnames"
        )
    return met


def open_segment(
    signed: SignedStore, met: Meeting, nbytes: int, timeout: timedelta
) -> tuple[str, mmap.mmap]:
    """Create (rank 0) or open the group's segment and map it: where its name would be in
    ``/dev/shm`` (never there once this returns) and the map.

    ``signed``: the group's signer, under a prefix of this segment's own (:data:`SEGMENT_KEY`
    for the group's segment), so that no segment's record can stand for another's."""
    deadline = time.monotonic() + timeout.total_seconds()
    if met.rank == 0:
        return _create(signed, met, nbytes, deadline, timeout)
    return _attach(signed, met, nbytes, deadline)


def _create(
    signed: SignedStore, met: Meeting, nbytes: int, deadline: float, timeout: timedelta
) -> tuple[str, mmap.mmap]:
    try:
        handle = create(nbytes, memfd=met.processes is not None and hasattr(os, "memfd_create"))
    except (SegmentError, OSError) as exc:
        signed.put("made", _Made(met.nonces, None, str(exc)).__dict__)
        raise
    try:
        mapped = mmap.mmap(handle.fd, nbytes)
        signed.put("made", _Made(met.nonces, handle.__dict__, "").__dict__)
        _wait_mapped(signed, met, deadline, timeout)
    except BaseException:
        close_created(handle)
        raise
    close_created(handle)  # every rank has its own mapping: the segment needs no name now
    return shm_path(handle.name), mapped


def _wait_mapped(signed: SignedStore, met: Meeting, deadline: float, timeout: timedelta) -> None:
    parse = lambda v: as_record(_Mapped, v)  # noqa: E731
    for r, nonce in enumerate(met.nonces):
        if r == 0:
            continue
        try:
            said = _wait_valid(signed, f"mapped/{r}", deadline, parse, _of(nonce))
        except TimeoutError as exc:
            raise TimeoutError(
                f"backend='shm': rank {r} did not map the group's shared segment within "
                f"{timeout.total_seconds():g} s ({exc}); start every rank, or check that they run"
            ) from None
        if said.error:
            raise RuntimeError(
                f"backend='shm': rank {r} could not map rank 0's segment: {said.error}"
            )


def _of(nonce: str) -> Callable[[_Mapped], bool]:
    return lambda mapped: mapped.nonce == nonce


def _attach(
    signed: SignedStore, met: Meeting, nbytes: int, deadline: float
) -> tuple[str, mmap.mmap]:
    mine = met.nonces[met.rank]
    parse = lambda v: as_record(_Made, v)  # noqa: E731
    try:
        made = _wait_valid(signed, "made", deadline, parse, lambda m: m.nonces == met.nonces)
    except TimeoutError as exc:
        raise TimeoutError(f"backend='shm': rank 0 made no segment for the group: {exc}") from None
    if made.error or made.handle is None:
        raise RuntimeError(
            f"backend='shm': rank 0 could not make the group's segment: {made.error}"
        )
    try:
        handle = as_record(Handle, made.handle)
        if met.processes is not None and handle.pid != met.processes[0][0]:
            raise SegmentError(f"the segment's creator pid {handle.pid} is not rank 0's")
        if handle.nbytes != nbytes:
            raise SegmentError(f"the segment has {handle.nbytes} bytes, this rank needs {nbytes}")
        fd = open_handle(handle)
    except (SegmentError, TypeError, OSError) as exc:
        signed.put(f"mapped/{met.rank}", _Mapped(mine, str(exc)).__dict__)
        raise
    try:
        mapped = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    signed.put(f"mapped/{met.rank}", _Mapped(mine, "").__dict__)
    return shm_path(handle.name), mapped
