"""``join()`` and ``barrier()``: points where every rank waits for the others.

``join()`` is Horovod's answer to uneven data: a rank that runs out calls it and keeps answering
the negotiation rounds of the ranks still working (``controller.py``). It takes part in their
all-reduces (``allreduce``, ``grouped_allreduce``, a ``DistributedOptimizer``'s gradient
all-reduces) with neutral values, and their ``barrier()``; allgather, broadcast, alltoall and
reducescatter raise on the ranks that call them while another has joined, as in Horovod. It
returns, on every rank, the rank that joined last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx._check import check_int
from phalanx.horovod.controller import NEUTRAL
from phalanx.horovod.process_sets import controller, global_process_set, resolve
from phalanx.horovod.protocol import Kind
from phalanx.horovod.requests import Agreement, Request

__all__ = ["barrier", "join"]


def _nothing(req: Request, agreement: Agreement) -> tuple[list[Any], Callable[[], None]]:
    # The negotiation round that admitted the barrier already had every rank in it.
    return [], lambda: None


NEUTRAL[Kind.BARRIER] = lambda desc: Request(Kind.BARRIER, None, [], _nothing)


def barrier(process_set: Any = None) -> None:
    """Block until every rank of ``process_set`` (default: all) has reached the barrier."""
    ps = resolve(process_set)
    controller(ps).submit(Request(Kind.BARRIER, None, [], _nothing), blocking=True).wait()


def join(device: int = -1) -> int:
    """Take part in the others' all-reduces with neutral values until every rank has joined.

    Args:
        device: Accepted for compatibility with Horovod (the device of its zero tensors).

    Returns:
        The global rank that called ``join()`` last (the same on every rank).
    """
    check_int("device", device, min=-1, where="hvd.join")
    resolve(None)
    return controller(global_process_set).join()
