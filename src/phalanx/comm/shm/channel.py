"""A group's shared segment as the collectives see it: typed slots, steps and barriers.

Every collective is a sequence of *steps*; a step uses the slots and result of one parity
(steps alternate), and has one or two barriers. The first step of a call publishes the call's
descriptor and checks everyone's after its first barrier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
from collections.abc import Callable

import torch

from phalanx.comm.call_sites import describe
from phalanx.comm.errors import CollectiveMismatchError
from phalanx.comm.shm.descriptor import Call, check_same, find_shift
from phalanx.comm.shm.errors import ShmError
from phalanx.comm.shm.layout import Layout
from phalanx.comm.shm.sync import Arrivals

__all__ = ["Channel", "guarded"]

_MAX_VIEWS = 512


class Channel:
    """Typed views of a mapped segment, and the barrier over its ranks."""

    def __init__(self, segment: mmap.mmap, layout: Layout, arrivals: Arrivals, label: str) -> None:
        self.segment = segment
        self.layout = layout
        self.rank = arrivals.rank
        self.world_size = layout.world_size
        self.label = label
        self.arrivals = arrivals
        self._bytes = torch.frombuffer(segment, dtype=torch.uint8)
        self._views: dict[tuple[int, int, torch.dtype, int], torch.Tensor] = {}
        self.steps = 0
        self.calls = 0
        self.broken: BaseException | None = None
        self._call = Call("none")
        self._packed = self._call.pack()
        self._descriptors = [
            [layout.descriptor(r, parity) for r in range(self.world_size)] for parity in (0, 1)
        ]
        self._prev_site = 0
        self._prev_signature = 0

    def close(self) -> None:
        """Drop every view of the segment and unmap it."""
        self._views.clear()
        self._bytes = torch.empty(0, dtype=torch.uint8)
        self.arrivals.release()
        # A caller may still hold a view (BufferError): the mapping then goes with the process.
        with contextlib.suppress(BufferError):
            self.segment.close()

    def capacity(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` that fit in one slot."""
        return self.layout.slot_bytes // dtype.itemsize

    def next_step(self) -> int:
        """Start a step; return its parity."""
        self.steps += 1
        return self.steps & 1

    def slot(self, parity: int, rank: int, dtype: torch.dtype, numel: int = -1) -> torch.Tensor:
        """The first ``numel`` elements (default: all) of rank ``rank``'s slot of ``parity``."""
        return self._view(parity, rank, dtype, numel)

    def result(self, parity: int, dtype: torch.dtype, numel: int = -1) -> torch.Tensor:
        """The first ``numel`` elements (default: all) of the result area of ``parity``."""
        return self._view(parity, self.world_size, dtype, numel)

    def _view(self, parity: int, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        # Slicing a tensor costs microseconds in Python; a bucketed training step asks for the
        # same few shapes again and again, so views are kept (a bounded number of them).
        key = (parity, index, dtype, numel)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > _MAX_VIEWS:
                self._views.clear()
            start = self.layout.slot(parity, index)
            view = self._bytes[start : start + self.layout.slot_bytes].view(dtype)
            view = view if numel < 0 else view[:numel]
            self._views[key] = view
        return view

    def begin(self, call: Call, timeout_s: float | None = None, site: int = 0) -> None:
        """Number a new call on this group; raise if an earlier failure broke the group.

        ``call``'s own number is ignored (so one ``Call`` may describe many calls alike).
        ``timeout_s``: the call's own timeout (None: the group's). ``site``: the line that
        issued it (``comm/call_sites.py``; 0: unknown or not compared)."""
        if self.broken is not None:
            raise ShmError(
                f"{self.label}: {call.kind} refused: the group failed earlier "
                f"({self.broken}); destroy it and start a new one"
            )
        self.arrivals.call_timeout_s = timeout_s
        self.calls += 1
        self._call = call
        self._packed = call.pack_as(self.calls, site, self._prev_site, self._prev_signature)
        self._prev_site, self._prev_signature = site, call.signature

    @property
    def current(self) -> Call:
        """The call running now, with its number."""
        return dataclasses.replace(self._call, number=self.calls)

    def what(self) -> str:
        return f"{self.label}: {self._call.kind} (call #{self.calls})"

    def publish(self, parity: int) -> None:
        """Write this rank's descriptor of the current call for the step of ``parity``."""
        offset = self._descriptors[parity][self.rank]
        self.segment[offset : offset + len(self._packed)] = self._packed

    def check(self, parity: int) -> None:
        """After the first barrier of a call: compare every rank's descriptor with ours."""
        packed, segment, size = self._packed, self.segment, len(self._packed)
        offsets = self._descriptors[parity]
        for o in offsets:
            if segment[o : o + size] != packed:
                calls = [Call.read(segment, o) for o in offsets]
                check_same(calls, self.what())
                self._check_shift(calls)
                return  # alike but for the offsets and lines, which are not compared

    def _check_shift(self, calls: list[Call]) -> None:
        """Raise on every rank when the previous call was paired wrongly (``find_shift``)."""
        shift = find_shift(calls)
        if shift is None:
            return
        a, b = shift
        n, kind = self.calls, self._call.kind
        raise CollectiveMismatchError(
            f"{self.what()}: call #{n - 1} was paired wrongly: rank {b}'s call #{n - 1} "
            f"({describe(calls[b].prev_site)}) is the call rank {a} makes now, as #{n}, while "
            f"rank {a}'s #{n - 1} came from {describe(calls[a].prev_site)}. Rank {a} made an "
            f"extra call, or rank {b} skipped one: the results of #{n - 1} are wrong on every "
            f"rank, and #{n} ({kind}) is refused on every rank before it reads any data. Every "
            "rank must make the same collective calls in the same order (PHALANX_CALL_SITES=0 "
            "turns this check off)"
        )

    def offsets(self, parity: int) -> list[int]:
        """Every rank's buffer offset in the current call (read after its first barrier)."""
        return [Call.read(self.segment, o).offset for o in self._descriptors[parity]]

    def barrier(self) -> None:
        self.arrivals.barrier(self.what)

    def first_barrier(self, parity: int) -> None:
        """The barrier that opens a call: publish, arrive, wait, compare descriptors."""
        self.publish(parity)
        self.barrier()
        self.check(parity)


def guarded(channel: Channel, body: Callable[[], None]) -> None:
    """Run ``body``; a failure other than a mismatch marks the group broken."""
    try:
        body()
    except CollectiveMismatchError:
        raise
    except BaseException as exc:
        channel.broken = exc
        channel.arrivals.fail()
        raise
