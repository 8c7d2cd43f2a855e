"""``ShmGroup``: what every ``backend="shm"`` group shows torch, in the forms torch's groups take.

torch's own ``ProcessGroup`` methods take several call forms: ``pg.allreduce([t])`` with
default options, ``pg.allreduce(t, ReduceOp.MAX)``, ``pg.broadcast(t, root)``,
``pg.allgather([out0, out1], t)``, ``pg.barrier()``, each with an optional ``timeout``. Code
that holds the group object calls them so: torch's DDP tests' communication hooks do
``dist.group.WORLD.allreduce(tensors)``, and for a Python backend ``dist.group.WORLD`` is the
group itself. torch's C++ callers (DDP's reducer, through the ``PyProcessGroup`` trampoline)
pass ``(tensors, opts)``. Each public method here takes every form, makes it
``(tensor lists, options)`` once, and calls the subclass's ``_allreduce``, ``_broadcast``, ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed

from phalanx.comm.shm.worker import Executor

__all__ = ["ShmGroup"]

_SUM = dist.ReduceOp.SUM


def _tensors(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _is_op(x: object) -> bool:
    return isinstance(x, (dist.ReduceOp, dist.ReduceOp.RedOpType))


def _options(cls: type, given: Any, where: str, timeout: timedelta | None, **fields: Any) -> Any:
    """``given`` if it is a ``cls``; a new ``cls`` with ``fields`` set if it is None. Either
    way with ``timeout`` when one is given."""
    if given is None:
        given = cls()
        for name, value in fields.items():
            setattr(given, name, value)
    elif not isinstance(given, cls):
        raise TypeError(f"{where}: opts must be a {cls.__name__} (or left out), got {given!r}")
    if timeout is not None:
        given.timeout = timeout
    return given


def _reduce_opts(cls: type, given: Any, where: str, timeout: timedelta | None) -> Any:
    """``given``: options of ``cls``, a reduce op, or None (SUM)."""
    if given is None or _is_op(given):
        op = _SUM if given is None else given
        return _options(cls, None, where, timeout, reduceOp=op)
    return _options(cls, given, where, timeout)


class ShmGroup(dist.ProcessGroup):
    """A ``backend="shm"`` group: its name, rank and size, and torch's call forms."""

    # What a subclass provides: its ordered queue of calls (``worker.py``), and each collective
    # on lists of tensors and one options object, which the public forms below call.
    _executor: Executor
    _allreduce: Callable[[list[torch.Tensor], Any], dist.Work]
    _reduce: Callable[[list[torch.Tensor], Any], dist.Work]
    _broadcast: Callable[[list[torch.Tensor], Any], dist.Work]
    _allgather: Callable[[list[list[torch.Tensor]], list[torch.Tensor], Any], dist.Work]
    _all_gather_single: Callable[[torch.Tensor, torch.Tensor, Any], dist.Work]
    _reduce_scatter: Callable[[list[torch.Tensor], list[list[torch.Tensor]], Any], dist.Work]
    _reduce_scatter_single: Callable[[torch.Tensor, torch.Tensor, Any], dist.Work]
    _all_to_all_single: Callable[[torch.Tensor, torch.Tensor, list[int], list[int], Any], dist.Work]
    _barrier: Callable[[Any], dist.Work]

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]  # (store, ...) fails
        self._rank, self._size = rank, world_size

    def getBackendName(self) -> str:  # torch's C++ name
        return "shm"

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

    def shutdown(self) -> None:
        """Release what the group holds (subclasses)."""

    def abort(self) -> None:
        self.shutdown()

    # -- torch's call forms -----------------------------------------------------------------
    def allreduce(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        opts: Any = None,
        timeout: timedelta | None = None,
    ) -> dist.Work:
        """``allreduce([t], opts)``, ``allreduce([t], op)`` or ``allreduce(t, op)``."""
        opts = _reduce_opts(dist.AllreduceOptions, opts, "allreduce", timeout)
        return self._allreduce(_tensors(tensors), opts)

    def reduce(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        opts: Any = None,
        op: Any = _SUM,
        timeout: timedelta | None = None,
    ) -> dist.Work:
        """``reduce([t], opts)`` or ``reduce(t, root, op)``."""
        if isinstance(opts, int):
            opts = _options(dist.ReduceOptions, None, "reduce", None, rootRank=opts, reduceOp=op)
        opts = _reduce_opts(dist.ReduceOptions, opts, "reduce", timeout)
        return self._reduce(_tensors(tensors), opts)

    def broadcast(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        opts: Any = None,
        timeout: timedelta | None = None,
    ) -> dist.Work:
        """``broadcast([t], opts)`` or ``broadcast(t, root)``."""
        root, opts = (opts, None) if isinstance(opts, int) else (0, opts)
        opts = _options(dist.BroadcastOptions, opts, "broadcast", timeout, rootRank=root)
        return self._broadcast(_tensors(tensors), opts)

    def allgather(  # type: ignore[override]  # torch's two overloads in one signature
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> dist.Work:
        """``allgather([[out0, ...]], [t], opts)`` or ``allgather([out0, ...], t, timeout)``."""
        if isinstance(input_tensors, torch.Tensor):
            output_tensors, input_tensors = [output_tensors], [input_tensors]
            opts, timeout = (None, opts) if isinstance(opts, timedelta) else (opts, timeout)
        outputs = [list(o) for o in output_tensors]
        opts = _options(AllgatherOptions, opts, "allgather", timeout)
        return self._allgather(outputs, list(input_tensors), opts)

    def all_gather_single(
        self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        """``_allgather_base(output, input, opts)``: into one tensor of world-size parts."""
        opts = _options(AllgatherOptions, opts, "_allgather_base", None)
        return self._all_gather_single(output, inp, opts)

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def reduce_scatter(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> dist.Work:
        """``reduce_scatter([out], [[in0, ...]], opts)`` or ``(out, [in0, ...], op)``."""
        if isinstance(output_tensors, torch.Tensor):
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        inputs = [list(i) for i in input_tensors]
        opts = _reduce_opts(dist.ReduceScatterOptions, opts, "reduce_scatter", timeout)
        return self._reduce_scatter(list(output_tensors), inputs, opts)

    def reduce_scatter_single(
        self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        """``_reduce_scatter_base(output, input, opts)``: world-size parts into one."""
        opts = _reduce_opts(dist.ReduceScatterOptions, opts, "_reduce_scatter_base", None)
        return self._reduce_scatter_single(output, inp, opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def all_to_all_single(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> dist.Work:
        """``alltoall_base(output, input, output_splits, input_splits, opts or timeout)``."""
        timeout, opts = (opts, None) if isinstance(opts, timedelta) else (None, opts)
        opts = _options(dist.AllToAllOptions, opts, "alltoall_base", timeout)
        return self._all_to_all_single(
            output, inp, list(output_split_sizes), list(input_split_sizes), opts
        )

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def barrier(self, opts: Any = None) -> dist.Work:
        """``barrier(opts)``, ``barrier(timeout)`` or ``barrier()``."""
        timeout, opts = (opts, None) if isinstance(opts, timedelta) else (None, opts)
        return self._barrier(_options(dist.BarrierOptions, opts, "barrier", timeout))

    # -- coalesced calls: what torch's functional collectives (DTensor) come in as ----------
    # Left to the C++ base, these went to the gloo group underneath with the GIL held, while
    # gloo's worker thread, holding its queue's lock, waited for the GIL to free a finished
    # call's tensors: a deadlock under load (tools/shm_dtensor_stall.py).
    def all_gather_single_coalesced(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """``all_gather_into_tensor`` of each (output, input) pair, as one work."""
        opts = _options(AllgatherOptions, opts, "allgather_into_tensor_coalesced", None)
        works = [self._all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._joined(works, list(outputs), opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """``reduce_scatter_tensor`` of each (output, input) pair, as one work."""
        opts = _reduce_opts(dist.ReduceScatterOptions, opts, "reduce_scatter_coalesced", None)
        pairs = zip(outputs, inputs, strict=True)
        works = [self._reduce_scatter_single(o, i, opts) for o, i in pairs]
        return self._joined(works, list(outputs), opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> dist.Work:
        """``all_reduce`` of each tensor, as one work."""
        given = _options(dist.AllreduceCoalescedOptions, opts, "allreduce_coalesced", None)
        one = _options(dist.AllreduceOptions, None, "allreduce_coalesced", None)
        one.reduceOp, one.timeout = given.reduceOp, given.timeout
        works = [self._allreduce([t], one) for t in tensors]
        return self._joined(works, list(tensors), given)

    def _joined(self, works: list[dist.Work], value: object, opts: Any) -> dist.Work:
        """One work that completes when every one of ``works`` has (raising the first error):
        a call queued after them on the group's executor, so waiting on it from C++ with the
        GIL held runs them on the waiting thread and needs no other thread."""

        def wait_all() -> None:
            for work in works:
                work.wait()

        return self._executor.submit(wait_all, value, wake=bool(getattr(opts, "asyncOp", True)))
