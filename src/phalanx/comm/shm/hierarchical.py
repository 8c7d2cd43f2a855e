"""``backend="shm"`` across machines: shared memory inside each machine, gloo between them.

When the ranks of a group run on several hosts (``segment.host_identity``), the group is a
:class:`HierarchicalProcessGroup`:

- the ranks of each host form an :class:`~phalanx.comm.shm.backend.ShmProcessGroup` of their
  own (over the store under ``phalanx_shm_host<i>/``);
- the first rank of each host (its *leader*) joins a gloo group of leaders;
- a gloo group of every rank, registered for the CPU device, carries every other call.

An ``all_reduce`` (the call of DDP's buckets) is reduced to the leader in shared memory,
all-reduced between the leaders over gloo, and broadcast back in shared memory: each machine
sends its sum once instead of every rank sending its own. ``AVG`` travels as ``SUM`` and is
divided at the end. Sums are added in another order than gloo's (within a host first), so
floating-point results match gloo's within rounding, integers and MIN / MAX exactly.
``barrier`` and every other collective (broadcast, all_gather, reduce_scatter, all_to_all,
P2P, object collectives) go to the gloo group (those torch's trampoline forwards, explicitly:
see the note above ``broadcast``): correct at any placement, without the shared-memory speed.
The group gives no shared buffers (``gives_shared_buffers`` is false), so DDP and ZeRO keep
their buffers in plain memory.

A failure between machines (a leader's gloo call raising) marks the host's shared group broken,
so that the ranks waiting for their leader fail at once instead of at the timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm.shm.backend import ShmProcessGroup, flat_cpu
from phalanx.comm.shm.base import ShmGroup
from phalanx.comm.shm.ops import AVG, check_reduction, op_code
from phalanx.comm.shm.worker import Executor

__all__ = ["HierarchicalProcessGroup"]

_GLOO_PREFIX = "phalanx_shm_gloo/"
_LEADERS_PREFIX = "phalanx_shm_leaders/"


class HierarchicalProcessGroup(ShmGroup):
    """An shm group whose ranks span several hosts (see the module docstring).

    Args:
        store: The group's store.
        rank: This rank in the group.
        world_size: Ranks in the group.
        timeout: Every call's timeout.
        hosts: Each rank's host (``segment.meet``); more than one distinct value.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: timedelta,
        hosts: Sequence[str],
    ) -> None:
        super().__init__(rank, world_size)
        order = list(dict.fromkeys(hosts))  # hosts in the order of their first rank
        mine = [r for r in range(world_size) if hosts[r] == hosts[rank]]
        index = order.index(hosts[rank])
        self.hosts = len(order)
        """How many machines the group spans."""
        self.local = ShmProcessGroup(
            dist.PrefixStore(f"phalanx_shm_host{index}/", store),
            mine.index(rank),
            len(mine),
            timeout,
        )
        """This host's ranks, on shared memory."""
        self.leaders: dist.ProcessGroupGloo | None = None
        """On a host's first rank: the gloo group of every host's first rank."""
        if rank == mine[0]:
            leaders_store = dist.PrefixStore(_LEADERS_PREFIX, store)
            self.leaders = dist.ProcessGroupGloo(leaders_store, index, len(order), timeout)
        gloo_store = dist.PrefixStore(_GLOO_PREFIX, store)
        self._gloo = dist.ProcessGroupGloo(gloo_store, rank, world_size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._executor = Executor(f"phalanx-shm-hier-rank{rank}")

    def shutdown(self) -> None:
        """Finish the queued calls; shut the host's group, the leaders' and gloo's down."""
        self._executor.stop()
        self.local.shutdown()
        if self.leaders is not None:
            self.leaders.shutdown()
        self._gloo.shutdown()

    def _allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        if len(tensors) != 1 or tensors[0].layout != torch.strided:  # sparse: gloo's
            return self._gloo.allreduce(tensors, opts)  # type: ignore[attr-defined]
        flat = flat_cpu(tensors[0], "tensor", "all_reduce")
        code = op_code(opts.reduceOp)
        check_reduction(code, flat.dtype, "all_reduce")
        op: Any = dist.ReduceOp.SUM if code == AVG else opts.reduceOp
        size = self._size

        def run() -> None:
            reduce = dist.ReduceOptions()
            reduce.rootRank, reduce.reduceOp = 0, op
            self.local.reduce([flat], reduce).wait()
            if self.leaders is not None:
                across = dist.AllreduceOptions()
                across.reduceOp = op
                try:
                    self.leaders.allreduce([flat], across).wait()  # type: ignore[attr-defined]
                except BaseException as exc:
                    self.local.fail(exc)  # the host's ranks wait for this leader
                    raise
            bcast = dist.BroadcastOptions()
            bcast.rootRank = 0
            self.local.broadcast([flat], bcast).wait()
            if code == AVG:
                flat.div_(size)

        return self._executor.submit(run, tensors, wake=bool(getattr(opts, "asyncOp", True)))

    # The calls torch's Python trampoline forwards (``PyProcessGroup``) go to gloo explicitly:
    # left to the trampoline's fallback, gloo's enqueue ran holding the GIL, while gloo's worker
    # thread, holding its queue's lock, waited for the GIL to free a finished call's tensors (a
    # deadlock seen under load). Called from Python, gloo's bindings release the GIL.
    def _broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._gloo.broadcast(tensors, opts)  # type: ignore[attr-defined]

    def _allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        return self._gloo.allgather(output_tensors, input_tensors, opts)  # type: ignore[attr-defined]

    def _all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> dist.Work:
        return self._gloo._allgather_base(output, inp, opts)  # type: ignore[attr-defined]

    def _reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any
    ) -> dist.Work:
        return self._gloo.reduce_scatter(output_tensors, input_tensors, opts)  # type: ignore[attr-defined]

    def _reduce_scatter_single(
        self, output: torch.Tensor, inp: torch.Tensor, opts: Any
    ) -> dist.Work:
        return self._gloo._reduce_scatter_base(output, inp, opts)  # type: ignore[attr-defined]

    def _all_to_all_single(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any,
    ) -> dist.Work:
        return self._gloo.alltoall_base(  # type: ignore[attr-defined]
            output, inp, output_split_sizes, input_split_sizes, opts
        )

    def _reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._gloo.reduce(tensors, opts)  # type: ignore[attr-defined]

    def _barrier(self, opts: Any) -> dist.Work:
        return self._gloo.barrier(opts)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"HierarchicalProcessGroup(rank={self._rank}, size={self._size}, hosts={self.hosts})"
