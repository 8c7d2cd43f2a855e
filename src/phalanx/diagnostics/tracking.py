"""Per-rank collective bookkeeping: sequence numbers, progress, the mismatch check, blame.

The wire (:mod:`phalanx.comm.watch`) tells this module of every operation: ``import phalanx``
installs it there as the watcher. Every collective issued through ``phalanx.comm.collectives``
reaches :func:`enter`, which bumps a per-group sequence number, leaves a flight record
(:mod:`.flight`), folds the call's signature into a rolling CRC (:mod:`.mismatch_check`) and
writes it into this rank's call ring (:mod:`.call_ring`), a few microseconds in all. A daemon
thread publishes this rank's progress (with its recent calls) to the rendezvous store twice a
second, compares it with its neighbours', re-arms the stuck-thread dump (:mod:`.rank_files`) and
watches for hangs (:mod:`.watchdog`). When a collective fails or times out :func:`failure` names
the ranks behind, the rank that died with its signal and call, and the calls that differ
(:mod:`.blame`).

With validation on (``validate=True`` / ``PHALANX_DEBUG=1``) each rank also compares a
fingerprint of every collective with everyone's before running it (:mod:`.validation`).
``PHALANX_MISMATCH_CHECK=0`` turns the always-on check (CRCs, comparison) off; the call ring
is written whenever the rank files exist: it is the failure report's evidence (about 1 µs).
The environment flags are read by ``init_process_group`` before rendezvous
(:mod:`phalanx.comm.flags`).

Point-to-point operations are recorded on their own channel (group :data:`P2P`, a counter of
their own, see :func:`p2p` and :mod:`phalanx.comm.work`): they never move the collectives'
sequence numbers, and the mismatch check does not see them.

:func:`add_record_sink` hands every record, collective or point-to-point, to a tool that keeps
them all (the ring keeps the last 256): the timeline's recorder (:mod:`.recorder`) registers
here.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm.call_sites import call_site
from phalanx.comm.errors import CollectiveError, CollectiveMismatchError
from phalanx.comm.flags import TrackingFlags
from phalanx.comm.signed import SignedStore
from phalanx.diagnostics import blame, watchdog
from phalanx.diagnostics import fingerprint as fpr
from phalanx.diagnostics.call_ring import read_calls
from phalanx.diagnostics.flight import FlightRecorder, Record
from phalanx.diagnostics.mismatch_check import Checker, neighbours
from phalanx.diagnostics.rank_files import Peer, RankFiles, open_rank_files, peers
from phalanx.diagnostics.snapshot import parse_progress
from phalanx.diagnostics.validation import Validator

__all__ = [
    "P2P",
    "add_record_sink",
    "call_site",
    "enter",
    "failure",
    "hang_reports",
    "leave",
    "mismatch_found",
    "p2p",
    "recorder",
    "remove_record_sink",
    "set_mismatch_check",
    "shape_text",
    "start",
    "stop",
]

PUBLISH_INTERVAL_S = 0.5
PUBLISH_STORE_TIMEOUT_S = 10.0
STORE_LOST_S = 10.0
"""The progress thread stops (and says so) once the store has failed this long in a row."""
P2P = "p2p"
"""The flight record's channel of point-to-point operations."""
log = logging.getLogger(__name__)


@dataclass
class _Tracker:
    store: SignedStore
    rank: int
    world_size: int
    validate: bool
    timeout_s: float
    seq: dict[str, int] = field(default_factory=dict)
    last_op: dict[str, str] = field(default_factory=dict)
    stop_event: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    watch: watchdog.Watchdog | None = None
    check: Checker | None = None
    checking: bool = False
    """The always-on check (rolling CRCs, comparison) runs."""
    files: RankFiles | None = None
    validator: Validator | None = None
    peers: dict[int, Peer] = field(default_factory=dict)

    def snapshot(self) -> dict[str, list[Any]]:
        """``{group: [seq, last op]}``, plus ``[crc, window]`` while the check runs."""
        # Copies first: the main thread adds groups while the progress thread reads.
        seq, ops = dict(self.seq), dict(self.last_op)
        snap: dict[str, list[Any]] = {g: [n, ops.get(g, "?")] for g, n in seq.items()}
        if self.check is not None and self.checking:
            self.check.extend(snap, _RECORDER)
        return snap


_T: _Tracker | None = None
_RECORDER = FlightRecorder()
_ATEXIT = False
_RANKS: dict[str, list[int]] = {}
_P2P_SEQ = itertools.count(1)  # atomic: a parameter server records from one thread per worker


def hang_reports() -> list[str]:
    """The hang reports this rank printed since the process group started."""
    return [] if _T is None or _T.watch is None else list(_T.watch.reports)


def mismatch_found() -> str | None:
    """The always-on check's finding on this rank (raised at its next collective), if any."""
    return None if _T is None or _T.check is None else _T.check.found


def set_mismatch_check(on: bool) -> None:
    """Turn the always-on check on or off (for A/B benchmarks).

    Call it on every rank at the same point of the program: the ranks' rolling CRCs must
    cover the same calls.
    """
    if _T is not None and _T.check is not None:
        _T.checking = bool(on)


def _compare(t: _Tracker, store: SignedStore, snap: dict[str, list[Any]]) -> None:
    if t.check is not None and t.checking:
        groups = [r for r in list(_RANKS.values()) if t.rank in r]
        t.check.tick(store, snap, neighbours(t.rank, groups), parse_progress)


def _publish(
    t: _Tracker, store: SignedStore, last: dict[str, list[Any]] | None
) -> dict[str, list[Any]]:
    snap = t.snapshot()
    if snap != last:
        store.put(f"progress/{t.rank}", snap)
    _compare(t, store, snap)
    if t.watch is not None:
        t.watch.tick(store)
    return snap


def _publisher(t: _Tracker, store: SignedStore) -> None:
    """The progress thread: publish, watch for hangs; an exception never ends it silently."""
    last: dict[str, list[Any]] | None = None
    failing_since: float | None = None
    bugs: set[str] = set()
    while not t.stop_event.wait(PUBLISH_INTERVAL_S):
        try:
            last = _publish(t, store, last)
            failing_since = None
        except (dist.DistError, OSError) as exc:  # the store did not answer
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since >= STORE_LOST_S:
                log.warning(
                    "rank %d: the rendezvous store has not answered for %.0f s (%s); progress "
                    "and live hang reports are off from now on",
                    t.rank,
                    STORE_LOST_S,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
                return
        except Exception as exc:  # a bug: say so once, keep watching
            if repr(exc) not in bugs:
                bugs.add(repr(exc))
                log.exception("rank %d: the progress thread hit an error; it goes on", t.rank)


def start(
    store: SignedStore | None,
    rank: int,
    world_size: int,
    validate: bool,
    timeout: timedelta,
    flags: TrackingFlags | None = None,
) -> None:
    """Begin tracking for the default group (``init_process_group`` calls it, through
    :mod:`phalanx.comm.watch`).

    ``flags`` are the environment's (:func:`~phalanx.comm.flags.tracking_flags`, read before
    rendezvous); None means the defaults.
    """
    global _T
    stop()
    if store is None:
        return
    flags = flags or TrackingFlags()
    t = _Tracker(store.sub("phalanx/"), rank, world_size, validate, timeout.total_seconds())
    if validate:
        t.validator = Validator(t.store, rank, t.timeout_s, flags.sites)
    if world_size > 1:
        t.check = Checker(rank, flags.sites)
        t.checking = flags.check
        try:
            t.files = open_rank_files(t.store, rank)
        except (dist.DistError, OSError) as exc:  # diagnostics must never stop a job starting
            log.warning("rank %d: no per-rank files (store: %s)", rank, exc)
        raw = store.store.clone()  # type: ignore[union-attr]
        # Bounded store calls let stop() always join the thread: a daemon thread still inside a
        # store call when the interpreter finalises dies in C++ (std::terminate, SIGABRT).
        raw.set_timeout(timedelta(seconds=PUBLISH_STORE_TIMEOUT_S))
        clone = store.over(raw).sub("phalanx/")
        t.watch = watchdog.Watchdog(_RECORDER, rank, world_size, flags.hang_timeout_s)
        t.thread = threading.Thread(
            target=_publisher, args=(t, clone), name="phalanx-progress", daemon=True
        )
        t.thread.start()
        global _ATEXIT
        if not _ATEXIT:
            atexit.register(stop)  # runs before finalisation, while the thread can still exit
            _ATEXIT = True
    _T = t


def stop() -> None:
    """Stop the progress thread; collectives are no longer tracked; this rank's files go."""
    global _T
    t = _T
    if t is not None:
        t.stop_event.set()
        if t.thread is not None:
            t.thread.join(timeout=PUBLISH_STORE_TIMEOUT_S + 5)
        if t.files is not None:
            t.files.close()
    _T = None
    _RANKS.clear()
    _RECORDER.forget_in_flight()  # a group re-made later must not inherit stale waits


def _group_ranks(group: dist.ProcessGroup | None) -> tuple[str, list[int]]:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    name = pg.group_name
    if name not in _RANKS:
        _RANKS[name] = dist.get_process_group_ranks(pg)
    return name, _RANKS[name]


def enter(
    op: str,
    group: dist.ProcessGroup | None,
    tensor: torch.Tensor | None = None,
    *,
    reduce_op: Any = None,
    root: int | None = None,
    compare_shape: bool = True,
) -> int:
    """Record that this rank reached collective ``op``; check it. Returns its seq.

    Raises:
        CollectiveMismatchError: the always-on check found that the ranks' calls differ.
    """
    t = _T
    if t is None:
        return -1
    name, ranks = _group_ranks(group)
    if t.rank not in ranks:
        return -1
    check = t.check if t.checking else None
    if check is not None and check.found is not None:
        raise CollectiveMismatchError(check.found)
    seq = t.seq.get(name, 0) + 1
    t.seq[name] = seq
    t.last_op[name] = op
    site = call_site()
    shape = shape_text(tensor, compare_shape)
    args = fpr.args_text(reduce_op, root)
    rec = _RECORDER.start(name, seq, op, shape, site, args=args)
    if check is not None:
        check.note(name, seq, op, shape, args)
    if t.files is not None:  # blame's evidence, check or not
        t.files.ring.write(rec)
    if t.validator is not None:
        fp = fpr.make(op, name, seq, tensor, reduce_op, root, compare_shape, site)
        t.validator.check(name, ranks, seq, fp)
    return seq


def leave(group: dist.ProcessGroup | None, seq: int) -> None:
    """Record that collective ``seq`` (from :func:`enter`) completed on this rank."""
    t = _T
    if seq >= 0 and t is not None:
        name = _group_ranks(group)[0]
        _RECORDER.finish(name, seq)
        if t.files is not None:
            t.files.ring.done(name, seq, time.time())


class _P2PRecord:
    """A send's or receive's flight record on the :data:`P2P` channel: its shape and call site
    taken when it is posted, its record opened when this rank starts to wait for it."""

    def __init__(self, op: str, peer: int, tensor: torch.Tensor | None, idle: bool) -> None:
        self.op, self.peer, self.idle = op, peer, idle
        self.shape = shape_text(tensor)
        self.site = call_site()  # where it was posted, not waited for
        self.seq: int | None = None

    def open(self) -> None:
        """Start the record (tracking stopped since the post: nothing)."""
        if _T is None:
            return
        self.seq = next(_P2P_SEQ)
        _RECORDER.start(
            P2P, self.seq, self.op, self.shape, self.site, peer=self.peer, idle=self.idle
        )

    def close(self) -> None:
        """Complete the record."""
        if self.seq is not None and _T is not None:
            _RECORDER.finish(P2P, self.seq)


def p2p(op: str, peer: int, tensor: torch.Tensor | None, idle: bool) -> _P2PRecord | None:
    """The record of a send or receive posted now (None while tracking is off: nothing to pay).

    ``idle``: a wait that may legitimately be long, recorded but never reported as a hang.
    """
    return None if _T is None else _P2PRecord(op, peer, tensor, idle)


def add_record_sink(sink: Callable[[Record], None]) -> None:
    """Hand every flight record this process starts from now on to ``sink`` as well.

    Records exist while tracking is on (``phalanx.init_process_group``); the sink is called on
    the thread that starts the operation, and the record's ``end`` is set later, in place.
    """
    _RECORDER.add_sink(sink)


def remove_record_sink(sink: Callable[[Record], None]) -> None:
    """Undo :func:`add_record_sink`."""
    _RECORDER.remove_sink(sink)


def recorder() -> FlightRecorder | None:
    """This process's flight recorder while tracking is on (from ``init_process_group``)."""
    return None if _T is None else _RECORDER


def shape_text(tensor: torch.Tensor | None, compare_shape: bool = True) -> str:
    """``[4, 2] float32`` as records show a tensor; ``[*] float32`` where ranks may pass
    different shapes (``compare_shape=False``); ``-`` for no tensor."""
    if tensor is None:
        return "-"
    dims = list(tensor.shape) if compare_shape else "[*]"
    return f"{dims} {str(tensor.dtype).removeprefix('torch.')}"


def _entered(t: _Tracker, rank: int) -> dict[str, list[Any]]:
    return t.store.get(f"progress/{rank}", parse_progress) or {}


def failure(op: str, seq: int, group: dist.ProcessGroup | None, exc: BaseException) -> Exception:
    """Turn a backend error from collective ``op`` #``seq`` into an error with the right blame.

    It names the always-on check's finding, the ranks that never reached the collective, a
    rank that died (its signal, the call it was in, its stack) and the calls that differ.
    """
    t = _T
    if t is None or seq < 0:
        return CollectiveError(f"{op} failed: {exc}")
    name, ranks = _group_ranks(group)
    watchdog.dump_on_failure(_RECORDER, t.rank)
    text = blame.backend_text(exc)
    found = _finding(t)
    account = _account(t, name, ranks, seq, not blame.timed_out(text), found is not None)
    return blame.error(t.rank, op, seq, name, text, found, account)


def _finding(t: _Tracker) -> str | None:
    """The always-on check's finding, from this rank or any other (read now)."""
    check = t.check
    if check is None or not t.checking:
        return None
    if check.found is None:
        try:
            check.poll(t.store)
        except Exception:
            return None
    return None if check.found is None else check.finding


def _account(
    t: _Tracker, name: str, ranks: list[int], seq: int, wait: bool, found: bool
) -> blame.Account | None:
    try:
        t.store.put(f"progress/{t.rank}", t.snapshot())
        others = [r for r in ranks if r != t.rank]
        missing = [r for r in others if r not in t.peers]
        t.peers.update(peers(t.store, missing))
        known: dict[int, Peer | None] = {r: t.peers.get(r) for r in others}
        mine = _RECORDER.tail(name, 64)
        if t.files is not None:
            mine = read_calls(t.files.ring.path) or mine
        return blame.explain(t.rank, known, name, seq, mine, partial(_entered, t), wait, found)
    except Exception:
        log.exception("rank %d: could not gather the evidence of a failed collective", t.rank)
        return None
