"""Horovod's semantics in phalanx.horovod, on 2 gloo ranks (what Horovod's own test file checks,
kept here so CI covers it without that file): the operations phalanx lacked, int16, errors on
every rank for mismatched calls, operations matched by name, process sets.

Expected values are computed locally from every rank's inputs; integer and power-of-two float
data make them exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import phalanx.horovod as hvd
from phalanx.comm.errors import CollectiveMismatchError
from phalanx.testing import run_distributed


def _eq(got: Any, want: torch.Tensor, what: str) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert torch.equal(got, want), f"{what}: got {got.tolist()}, want {want.tolist()}"


# ---- operations phalanx lacked, and int16 ------------------------------------------------------
def _int16(r: int) -> None:
    base = torch.tensor([[1000, -7], [3, 30000]], dtype=torch.int16)
    xs = [base * (s + 1) for s in range(2)]  # int16 arithmetic: 30000 * 2 wraps around
    total = xs[0] + xs[1]  # what Horovod's int16 sum gives: wrapped the same way
    _eq(hvd.allreduce(xs[r], op=hvd.Sum), total, "int16 allreduce")
    _eq(hvd.allreduce(xs[r], op=hvd.Min), torch.minimum(xs[0], xs[1]), "int16 min")
    _eq(hvd.allgather(xs[r]), torch.cat(xs), "int16 allgather")
    _eq(hvd.broadcast(xs[r], 1), xs[1], "int16 broadcast")
    _eq(hvd.alltoall(xs[r]), torch.cat([xs[0][r : r + 1], xs[1][r : r + 1]]), "int16 alltoall")
    _eq(hvd.reducescatter(xs[r], op=hvd.Sum), total[r : r + 1], "int16 reducescatter")
    _eq(hvd.grouped_allreduce([xs[r]], op=hvd.Sum)[0], total, "int16 grouped allreduce")


def _reducescatter(r: int) -> None:
    x = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3) * (r + 1)  # 5 rows: 3 + 2
    total = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3) * 3
    mine = slice(0, 3) if r == 0 else slice(3, 5)
    _eq(hvd.reducescatter(x, op=hvd.Sum), total[mine], "reducescatter, uneven rows")
    _eq(hvd.reducescatter(x), total[mine] / 2, "reducescatter average")
    got = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
    _eq(got, total[mine] * 2, "reducescatter pre/postscale")
    _eq(hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum)), total[mine], "async")
    ints = torch.tensor([[r + 1], [10 * (r + 1)]])
    outs = hvd.grouped_reducescatter([x, ints], op=hvd.Sum)
    _eq(outs[0], total[mine], "grouped reducescatter float")
    _eq(outs[1], torch.tensor([[3], [30]])[r : r + 1], "grouped reducescatter int")
    handle = hvd.grouped_reducescatter_async([x], op=hvd.Average)
    _eq(hvd.synchronize(handle)[0], total[mine] / 2, "grouped async")
    w = x.clone().requires_grad_()
    hvd.reducescatter(w, op=hvd.Sum).sum().backward()
    _eq(w.grad, torch.full((5, 3), 2.0), "reducescatter gradient: allgather of ones, times n")


def _grouped_allgather_and_sparse(r: int) -> None:
    a = torch.full((r + 1, 2), float(r))
    b = torch.tensor([r, r], dtype=torch.int16)
    got = hvd.grouped_allgather([a, b])
    _eq(got[0], torch.cat([torch.zeros(1, 2), torch.ones(2, 2)]), "grouped allgather, rows 1+2")
    _eq(got[1], torch.tensor([0, 0, 1, 1], dtype=torch.int16), "grouped allgather int16")
    _eq(hvd.synchronize(hvd.grouped_allgather_async([b]))[0], got[1], "grouped async")
    dense = torch.zeros(4, 3)
    dense[r, :] = r + 1.0
    dense[3, 0] = 2.0
    summed = hvd.sparse_allreduce_async(dense.to_sparse(), name="emb", op=hvd.Sum)()
    assert summed.is_sparse
    want = torch.zeros(4, 3)
    want[0, :], want[1, :], want[3, 0] = 1.0, 2.0, 4.0
    _eq(summed.to_dense(), want, "sparse_allreduce_async sum")
    averaged = hvd.sparse_allreduce_async(dense.to_sparse(), op=hvd.Average)()
    _eq(averaged.to_dense(), want / 2, "sparse_allreduce_async average")


def _process_sets(r: int) -> None:
    evens, odds = hvd.add_process_set([0]), hvd.add_process_set(hvd.ProcessSet([1]))
    assert (evens.process_set_id, odds.process_set_id) == (1, 2)
    mine, other = (evens, odds) if r == 0 else (odds, evens)
    assert (mine.size(), mine.rank(), mine.included()) == (1, 0, True)
    assert (other.rank(), other.included()) == (None, False)
    assert hvd.global_process_set.ranks == [0, 1] and hvd.global_process_set.size() == 2
    x = torch.tensor([float(r + 1)])
    _eq(hvd.allreduce(x, op=hvd.Sum, process_set=mine), x, "allreduce on a set of one")
    _eq(hvd.allgather(x, process_set=mine), x, "allgather on a set of one")
    _expect(ValueError, lambda: hvd.add_process_set([1, 0]), "duplicate process set")
    _expect(ValueError, lambda: hvd.allreduce(x, process_set=other), "not in process set")
    assert hvd.remove_process_set(mine) and not hvd.remove_process_set(mine)
    assert mine.process_set_id is None and mine.size() is None
    _expect(ValueError, lambda: hvd.allreduce(x, process_set=mine), "add_process_set")
    assert hvd.remove_process_set(other)


def _expect(kind: type[BaseException], fn: Callable[[], Any], *words: str) -> str:
    try:
        fn()
    except kind as exc:
        for w in words:
            assert w in str(exc), f"{w!r} not in: {exc}"
        return str(exc)
    raise AssertionError(f"no {kind.__name__} raised; expected one mentioning {words}")


def _new_operations() -> bool:
    r = hvd.rank()
    for check in (_int16, _reducescatter, _grouped_allgather_and_sparse, _process_sets):
        check(r)
    return True


def test_reducescatter_grouped_sparse_int16_and_process_sets() -> None:
    assert run_distributed(_new_operations, world_size=2, timeout=60) == [True, True]


# ---- mismatched calls raise on every rank ------------------------------------------------------
def _mismatch(fn: Callable[[], Any], *words: str) -> None:
    message = _expect(
        CollectiveMismatchError, fn, f"[rank {hvd.rank()}]", "rank 0", "rank 1", *words
    )
    assert "Every rank must" in message or "every rank must" in message, message


def _mismatches() -> bool:
    r = hvd.rank()
    assert issubclass(CollectiveMismatchError, RuntimeError)
    _mismatch(lambda: hvd.allreduce(torch.ones(3 + r)), "allreduce", "shapes", "[3]", "[4]")
    _mismatch(lambda: hvd.allreduce(torch.ones([2, 3] if r else [6])), "[2, 3]", "[6]")
    _mismatch(
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32 if r else torch.float32)),
        "data types",
        "int32",
        "float32",
    )
    _mismatch(lambda: hvd.broadcast(torch.ones(2), r), "broadcast", "root", "root 0", "root 1")
    _mismatch(lambda: hvd.allreduce(torch.ones(2), op=hvd.Max if r else hvd.Sum), "hvd.Max")
    _mismatch(lambda: hvd.allgather(torch.ones(1, 2 + r)), "allgather", "[*, 2]", "[*, 3]")
    _mismatch(lambda: hvd.alltoall(torch.ones(2, 1 + r)), "alltoall", "[*, 1]", "[*, 2]")
    _mismatch(lambda: hvd.reducescatter(torch.ones(4 + r)), "reducescatter", "[4]", "[5]")
    _mismatch(
        lambda: hvd.allgather(torch.ones(1)) if r else hvd.allreduce(torch.ones(1)),
        "different operations",
        "is in allgather",
        "is in allreduce",
    )
    _mismatch(
        lambda: hvd.allreduce(torch.ones(1), name=f"loss{r}"),
        "no operation can run",
        "'loss0'",
        "'loss1'",
    )
    _eq(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), 2.0), "still healthy")
    return True


def test_mismatched_calls_raise_on_every_rank_and_the_job_goes_on() -> None:
    assert run_distributed(_mismatches, world_size=2, timeout=60) == [True, True]


# ---- operations are matched by name ------------------------------------------------------------
def _names() -> bool:
    r = hvd.rank()
    x = torch.tensor([1.0, 2.0]) * (r + 1)
    handle = hvd.allreduce_async(x, name="grad", op=hvd.Sum)
    _expect(ValueError, lambda: hvd.allreduce_async(x, name="grad"), "'grad'", "in flight")
    _eq(hvd.synchronize(handle), torch.tensor([3.0, 6.0]), "named allreduce")
    hvd.synchronize(hvd.allreduce_async(x, name="grad"))  # the name is free again
    if r == 0:  # rank 1 is in the barrier: the request waits, matched later by its name
        late = hvd.allreduce_async(x, name="late", op=hvd.Sum)
        assert not hvd.poll(late)
        hvd.barrier()
    else:
        hvd.barrier()
        late = hvd.allreduce_async(x, name="late", op=hvd.Sum)
    _eq(hvd.synchronize(late), torch.tensor([3.0, 6.0]), "deferred, then matched by name")
    first, second = ("p", "q") if r == 0 else ("q", "p")  # opposite orders on the two ranks
    handles = {n: hvd.allgather_async(torch.tensor([r]), name=n) for n in (first, second)}
    for n in ("p", "q"):
        _eq(hvd.synchronize(handles[n]), torch.tensor([0, 1]), f"{n} issued in another order")
    return True


def test_operations_match_by_name_in_any_order_and_names_in_flight_are_refused() -> None:
    assert run_distributed(_names, world_size=2, timeout=60) == [True, True]
