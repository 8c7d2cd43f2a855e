"""Per-rank collective bookkeeping: sequence numbers, progress in the store, validation.

Every collective issued through ``phalanx.comm.collectives`` calls :func:`enter`, which bumps a
per-group sequence number (an integer increment on the hot path). A daemon thread publishes this
rank's progress to the rendezvous store twice a second, so when a collective fails or times out
:func:`failure` can name the ranks that never reached it.

With validation on (``validate=True`` / ``PHALANX_DEBUG=1``) each rank also writes a fingerprint
(op, reduce op, shape, dtype, root, call site) under ``fp/<group>/<seq>/<rank>`` before the
collective and compares all of them; every rank raises the same
:class:`~phalanx.comm.errors.CollectiveMismatchError` instead of aborting or hanging.

Point-to-point operations are recorded on their own channel (group :data:`P2P`, a counter of
their own, see :mod:`phalanx.comm.work`): they never move the collectives' sequence numbers.
"""

from __future__ import annotations

import atexit
import logging
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import fingerprint as fpr
from phalanx.comm import watchdog
from phalanx.comm.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from phalanx.comm.flight import FlightRecorder
from phalanx.comm.signed import SignedStore

__all__ = [
    "P2P",
    "call_site",
    "comm_stats",
    "enter",
    "failure",
    "hang_reports",
    "leave",
    "recorder",
    "reset_comm_stats",
    "shape_text",
    "start",
    "stop",
]

PUBLISH_INTERVAL_S = 0.5
PUBLISH_STORE_TIMEOUT_S = 10.0
STORE_LOST_S = 10.0
"""The progress thread stops (and says so) once the store has failed this long in a row."""
POLL = timedelta(seconds=1)
RETRY_S = 0.01
P2P = "p2p"
"""The flight record's channel of point-to-point operations."""
TRANSPORTS = ("phalanx/comm/", "torch/", "phalanx/pipeline/p2p.py", "phalanx/parameter_server/wire")
"""Frames a record's call site skips: the code that only moves tensors for its caller."""
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

    def snapshot(self) -> dict[str, list[Any]]:
        # Copies first: the main thread adds groups while the progress thread reads.
        seq, ops = dict(self.seq), dict(self.last_op)
        return {g: [n, ops.get(g, "?")] for g, n in seq.items()}


_T: _Tracker | None = None
_RECORDER = FlightRecorder()
_ATEXIT = False
_RANKS: dict[str, list[int]] = {}
_CALLS: dict[str, int] = {}
_BYTES: dict[str, int] = {}


def comm_stats() -> dict[str, tuple[int, int]]:
    """``{op: (calls, bytes)}`` of the collectives this process issued through phalanx.

    Bytes are those of the tensor each call was given (the input of a reduction, the local
    shard of an all-gather), counted since the last :func:`reset_comm_stats`.
    """
    return {op: (n, _BYTES.get(op, 0)) for op, n in _CALLS.items()}


def reset_comm_stats() -> None:
    """Zero the counters of :func:`comm_stats`."""
    _CALLS.clear()
    _BYTES.clear()


def hang_reports() -> list[str]:
    """The hang reports this rank printed since the process group started."""
    return [] if _T is None or _T.watch is None else list(_T.watch.reports)


def _publish(
    t: _Tracker, store: SignedStore, last: dict[str, list[Any]] | None
) -> dict[str, list[Any]]:
    snap = t.snapshot()
    if snap != last:
        store.put(f"progress/{t.rank}", snap)
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
    store: SignedStore | None, rank: int, world_size: int, validate: bool, timeout: timedelta
) -> None:
    """Begin tracking for the default group (called by ``init_process_group``)."""
    global _T
    stop()
    if store is None:
        return
    t = _Tracker(store.sub("phalanx/"), rank, world_size, validate, timeout.total_seconds())
    if world_size > 1:
        raw = store.store.clone()  # type: ignore[attr-defined]
        # Bounded store calls let stop() always join the thread: a daemon thread still inside a
        # store call when the interpreter finalises dies in C++ (std::terminate, SIGABRT).
        raw.set_timeout(timedelta(seconds=PUBLISH_STORE_TIMEOUT_S))
        clone = store.over(raw).sub("phalanx/")
        t.watch = watchdog.Watchdog(_RECORDER, rank, world_size)
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
    """Stop the progress thread; collectives are no longer tracked."""
    global _T
    if _T is not None:
        _T.stop_event.set()
        if _T.thread is not None:
            _T.thread.join(timeout=PUBLISH_STORE_TIMEOUT_S + 5)
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
    """Record that this rank reached collective ``op``; validate it if enabled. Returns its seq."""
    _CALLS[op] = _CALLS.get(op, 0) + 1
    if tensor is not None:
        _BYTES[op] = _BYTES.get(op, 0) + tensor.numel() * tensor.element_size()
    t = _T
    if t is None:
        return -1
    name, ranks = _group_ranks(group)
    if t.rank not in ranks:
        return -1
    seq = t.seq.get(name, 0) + 1
    t.seq[name] = seq
    t.last_op[name] = op
    site = call_site()
    _RECORDER.start(name, seq, op, shape_text(tensor), site)
    if t.validate:
        fp = fpr.make(op, name, seq, tensor, reduce_op, root, compare_shape, site)
        _validate(t, name, ranks, seq, fp)
    return seq


def leave(group: dist.ProcessGroup | None, seq: int) -> None:
    """Record that collective ``seq`` (from :func:`enter`) completed on this rank."""
    if seq >= 0 and _T is not None:
        _RECORDER.finish(_group_ranks(group)[0], seq)


def recorder() -> FlightRecorder | None:
    """This process's flight recorder while tracking is on (from ``init_process_group``)."""
    return None if _T is None else _RECORDER


def shape_text(tensor: torch.Tensor | None) -> str:
    """``[4, 2] float32`` (``-`` for no tensor), as records show a tensor."""
    if tensor is None:
        return "-"
    return f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def call_site() -> str:
    """``file:line in function`` of the first caller outside the transports (:data:`TRANSPORTS`)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if not any(part in path for part in TRANSPORTS):
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def _validate(t: _Tracker, name: str, ranks: list[int], seq: int, fp: dict[str, Any]) -> None:
    def key(s: int, r: int) -> str:
        return f"fp/{name}/{s}/{r}"

    t.store.put(key(seq, t.rank), fp)
    keys = [key(seq, r) for r in ranks]
    start = time.monotonic()
    while True:
        try:
            t.store.wait_exists(keys, POLL)
            present = dict(zip(ranks, keys))
        except RuntimeError:  # not every rank has published yet (DistStoreError: timeout)
            present = {r: k for r, k in zip(ranks, keys) if t.store.exists([k])}
        seen = _load(t, present)
        if fpr.mismatch(seen):
            raise CollectiveMismatchError(fpr.mismatch_message(t.rank, name, seq, seen))
        if len(seen) == len(ranks):
            break
        waited = time.monotonic() - start
        if waited >= t.timeout_s:
            missing = [r for r in ranks if r not in seen]
            raise CollectiveTimeoutError(_timeout_message(t, fp, missing, waited))
        time.sleep(RETRY_S)  # a forged value sits where a rank's will be: read again
    if seq > 1:  # everyone has read seq-1 once all of seq is published
        t.store.delete(key(seq - 1, t.rank))


def _fingerprint(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("seq"), int):
        raise TypeError("a fingerprint is an object with an integer seq")
    return value


def _load(t: _Tracker, keys: dict[int, str]) -> dict[int, dict[str, Any]]:
    """The valid fingerprints at ``keys`` (which exist); forged ones are left out."""
    if not keys:
        return {}
    values = t.store.get_present(list(keys.values()), _fingerprint)
    return {r: v for r, v in zip(keys, values) if v is not None}


def _timeout_message(t: _Tracker, fp: dict[str, Any], missing: list[int], waited: float) -> str:
    return (
        f"[rank {t.rank}] {fpr.describe(fp)} (collective #{fp['seq']} on group "
        f"{fp['group']}) timed out after {waited:.0f} s: rank(s) {missing} never reached it. "
        f"{_progress_of(t, fp['group'], missing)}Check those ranks' logs: they may have crashed, "
        f"hang in other code, or skipped this collective."
    )


def _progress(value: Any) -> dict[str, list[Any]]:
    """A published snapshot: ``{group: [seq, last op]}``."""
    if not isinstance(value, dict):
        raise TypeError("a progress snapshot is an object")
    for entry in value.values():
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)):
            raise TypeError(f"a progress entry is [seq, op], got {entry!r}")
    return value


def _entered(t: _Tracker, rank: int) -> dict[str, list[Any]]:
    return t.store.get(f"progress/{rank}", _progress) or {}


def _progress_of(t: _Tracker, name: str, ranks: list[int]) -> str:
    parts = []
    for r in ranks:
        try:
            seen = _entered(t, r)
        except Exception:
            return ""
        if name not in seen:
            parts.append(f"rank {r} reported no collective yet")
        else:
            parts.append(f"rank {r} last entered #{seen[name][0]} ({seen[name][1]})")
    return "; ".join(parts) + ". " if parts else ""


def failure(op: str, seq: int, group: dist.ProcessGroup | None, exc: BaseException) -> Exception:
    """Turn a backend error from collective ``op`` #``seq`` into an error naming the laggards."""
    t = _T
    if t is None or seq < 0:
        return CollectiveError(f"{op} failed: {exc}")
    name, ranks = _group_ranks(group)
    behind = _ranks_behind(t, name, ranks, seq)
    watchdog.dump_on_failure(_RECORDER, t.rank)
    text = _backend_text(exc)
    timed_out = "timeout" in text.lower() or "timed out" in text.lower()
    kind = CollectiveTimeoutError if timed_out else CollectiveError
    where = f"[rank {t.rank}] {op} (collective #{seq} on group {name})"
    if behind:
        detail = f"rank(s) {behind} never reached it. {_progress_of(t, name, behind)}"
    else:
        detail = "every rank had reached it (a peer may have died during it). "
    verb = "timed out" if timed_out else "failed"
    return kind(f"{where} {verb}: {detail}Backend said: {text}")


def _backend_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    # gloo prefixes its source location: "[/path/to/unbound_buffer.cc:78] Timed out ..."
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", lines[0])


def _ranks_behind(t: _Tracker, name: str, ranks: list[int], seq: int) -> list[int]:
    try:
        t.store.put(f"progress/{t.rank}", t.snapshot())
        return [r for r in ranks if _entered(t, r).get(name, [0])[0] < seq]
    except Exception:
        return []
