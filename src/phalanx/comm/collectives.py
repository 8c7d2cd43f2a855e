"""The seeds' communication primitives with torch's signatures, tracked and optionally validated.

Each function forwards to ``torch.distributed`` after :func:`watch.enter` has recorded it, and
turns a backend failure into an error naming the operation, its sequence number and the ranks
that never reached it. Two additions over torch: ``ReduceOp.AVG`` works on gloo too (sum, then
divide), and ``all_reduce(..., algorithm="ring" | "tree")`` runs phalanx's explicit algorithms.
Point-to-point operations are in :mod:`phalanx.comm.p2p`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from phalanx._check import check_bool, check_choice, check_group, check_instance, check_int
from phalanx.comm import wait_clock, watch
from phalanx.comm.errors import CollectiveError
from phalanx.comm.work import CollectiveEntry, TrackedWork

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
]

Group = dist.ProcessGroup | None
# torch 2.13 renamed the tensor forms (and deprecated the old names); older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALGORITHMS = ("native", "ring", "tree")


def check_args(where: str, group: Any, async_op: Any = False, **named: Any) -> None:
    """The types (and ranks' ranges) of a collective's arguments, before anything runs.

    By name: ``op`` a ReduceOp, ``src`` / ``dst`` a global rank, ``tag`` an int, ``*object*`` a
    list, ``*_list`` a list of tensors (None allowed where torch ignores it), the rest a tensor.
    """
    check_group("group", group, where=where)
    check_bool("async_op", async_op, where=where)
    if not dist.is_initialized():
        raise ValueError(
            f"{where}: the default process group has not been initialized; call "
            f"phalanx.init_process_group() first (launch with `phalanx run`)"
        )
    for name, value in named.items():
        if name == "op":
            what = "a torch.distributed.ReduceOp, e.g. ReduceOp.SUM"
            check_instance(name, value, (ReduceOp, ReduceOp.RedOpType), what, where=where)
        elif name in ("src", "dst"):
            check_int(name, value, min=0, max=dist.get_world_size() - 1, where=where)
        elif name == "tag":
            check_int(name, value, where=where)
        elif "object" in name:
            if value is not None:
                check_instance(name, value, list, "a list", where=where)
        elif name.endswith("_list"):
            if value is not None:
                check_instance(name, value, list, "a list of tensors", where=where)
                for i, t in enumerate(value):
                    check_instance(f"{name}[{i}]", t, torch.Tensor, "a tensor", where=where)
        else:
            check_instance(name, value, torch.Tensor, "a torch.Tensor", where=where)


def _run(
    op: str,
    group: Group,
    call: Callable[[], Any],
    tensor: torch.Tensor | None = None,
    *,
    reduce_op: Any = None,
    root: int | None = None,
    compare_shape: bool = True,
    post: Callable[[], None] | None = None,
) -> Any:
    seq = watch.enter(
        op, group, tensor, reduce_op=reduce_op, root=root, compare_shape=compare_shape
    )
    try:
        with wait_clock.blocked():  # a blocking call's whole time; an async one's launch
            work = call()
    except CollectiveError:
        raise
    except RuntimeError as exc:
        raise watch.failure(op, seq, group, exc) from exc
    if work is None:
        watch.leave(group, seq)
        if post is not None:
            post()
        return None
    return TrackedWork(work, CollectiveEntry(op, seq, group), post)


def _avg_on_gloo(op: Any, group: Group) -> bool:
    return op == ReduceOp.AVG and dist.get_backend(group) == "gloo"


def _divide_by_size(tensors: list[torch.Tensor], group: Group) -> Callable[[], None]:
    for t in tensors:
        if not (t.is_floating_point() or t.is_complex()):
            raise TypeError(f"ReduceOp.AVG needs a floating-point tensor, got dtype {t.dtype}")
    size = dist.get_world_size(group)

    def divide() -> None:
        for t in tensors:
            t.div_(size)

    return divide


def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    *,
    algorithm: str = "native",
) -> Any:
    """Reduce ``tensor`` across the group in place; every rank gets the result.

    ``algorithm``: "native" (the backend's), "ring" (reduce-scatter then all-gather over P2P)
    or "tree" (binomial-tree reduce then broadcast). All give the same result.
    """
    check_args("all_reduce", group, async_op, tensor=tensor, op=op)
    check_choice("algorithm", algorithm, ALGORITHMS, where="all_reduce")
    if algorithm != "native":
        if async_op:
            raise ValueError(f"async_op=True needs algorithm='native', got {algorithm!r}")
        from phalanx.comm import algorithms

        impl = algorithms.ring_all_reduce if algorithm == "ring" else algorithms.tree_all_reduce
        return _run("all_reduce", group, lambda: impl(tensor, op, group), tensor, reduce_op=op)
    post = None
    call_op = op
    if _avg_on_gloo(op, group):
        post, call_op = _divide_by_size([tensor], group), ReduceOp.SUM
    return _run(
        "all_reduce",
        group,
        lambda: dist.all_reduce(tensor, call_op, group, async_op),
        tensor,
        reduce_op=op,
        post=post,
    )


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``tensor`` across the group onto global rank ``dst``."""
    check_args("reduce", group, async_op, tensor=tensor, dst=dst, op=op)
    post, call_op = None, op
    if _avg_on_gloo(op, group):
        call_op = ReduceOp.SUM
        if dist.get_rank() == dst:
            post = _divide_by_size([tensor], group)
    return _run(
        "reduce",
        group,
        lambda: dist.reduce(tensor, dst, call_op, group, async_op),
        tensor,
        reduce_op=op,
        root=dst,
        post=post,
    )


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op: bool = False) -> Any:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group."""
    check_args("broadcast", group, async_op, tensor=tensor, src=src)
    return _run(
        "broadcast", group, lambda: dist.broadcast(tensor, src, group, async_op), tensor, root=src
    )


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """Gather every rank's ``tensor`` into ``tensor_list`` on every rank."""
    check_args("all_gather", group, async_op, tensor_list=tensor_list, tensor=tensor)
    return _run(
        "all_gather",
        group,
        lambda: dist.all_gather(tensor_list, tensor, group, async_op),
        tensor,
    )


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False
) -> Any:
    """Gather every rank's ``input`` into the concatenated ``output`` on every rank."""
    check_args("all_gather_into_tensor", group, async_op, output=output, input=input)
    return _run(
        "all_gather_into_tensor",
        group,
        lambda: _all_gather_single(output, input, group, async_op),
        input,
    )


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """Gather every rank's ``tensor`` into ``gather_list`` on global rank ``dst``."""
    check_args("gather", group, async_op, tensor=tensor, gather_list=gather_list, dst=dst)
    return _run(
        "gather",
        group,
        lambda: dist.gather(tensor, gather_list, dst, group, async_op),
        tensor,
        root=dst,
    )


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """Send ``scatter_list[i]`` from global rank ``src`` to rank i's ``tensor``."""
    check_args("scatter", group, async_op, tensor=tensor, scatter_list=scatter_list, src=src)
    return _run(
        "scatter",
        group,
        lambda: dist.scatter(tensor, scatter_list, src, group, async_op),
        tensor,
        root=src,
    )


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``input_list`` elementwise across ranks; rank i receives entry i in ``output``."""
    check_args("reduce_scatter", group, async_op, output=output, input_list=input_list, op=op)
    post, call_op = None, op
    if _avg_on_gloo(op, group):
        post, call_op = _divide_by_size([output], group), ReduceOp.SUM
    return _run(
        "reduce_scatter",
        group,
        lambda: dist.reduce_scatter(output, input_list, call_op, group, async_op),
        output,
        reduce_op=op,
        post=post,
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``input`` across ranks; rank i receives the i-th equal slice in ``output``."""
    check_args("reduce_scatter_tensor", group, async_op, output=output, input=input, op=op)
    post, call_op = None, op
    if _avg_on_gloo(op, group):
        post, call_op = _divide_by_size([output], group), ReduceOp.SUM
    return _run(
        "reduce_scatter_tensor",
        group,
        lambda: _reduce_scatter_single(output, input, call_op, group, async_op),
        input,
        reduce_op=op,
        post=post,
    )


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """Rank i sends ``input_tensor_list[j]`` to rank j, receiving into ``output_tensor_list``."""
    check_args(
        "all_to_all",
        group,
        async_op,
        output_tensor_list=output_tensor_list,
        input_tensor_list=input_tensor_list,
    )
    return _run(
        "all_to_all",
        group,
        lambda: dist.all_to_all(output_tensor_list, input_tensor_list, group, async_op),
        input_tensor_list[0] if input_tensor_list else None,
        compare_shape=False,
    )


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """Split ``input`` along dim 0, send piece j to rank j, concatenate what arrives."""
    check_args("all_to_all_single", group, async_op, output=output, input=input)
    even = output_split_sizes is None and input_split_sizes is None
    return _run(
        "all_to_all_single",
        group,
        lambda: dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group, async_op
        ),
        input,
        compare_shape=even,
    )


def barrier(group: Group = None, async_op: bool = False) -> Any:
    """Block until every rank of the group has reached the barrier."""
    check_args("barrier", group, async_op)
    return _run("barrier", group, lambda: dist.barrier(group, async_op))
