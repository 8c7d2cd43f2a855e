"""Every phalanx collective × reduce op × dtype × uneven size, at 2, 3 and 4 ranks.

Each rank's input is a deterministic function of (rank, size, dtype), so every expected value is
computed locally from all ranks' inputs. Values are small integers, exact in every dtype here,
so results must be bit-identical whatever the reduction order: ``torch.equal`` throughout, and
``algorithm="ring"`` / ``"tree"`` must equal native for every case. All cases of one world size
run inside a single ``run_distributed`` call (cheap on 2 cores); each yields (case, ok, detail).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

import phalanx
from phalanx.comm import algorithms
from phalanx.testing import run_distributed

DTYPES = {
    "float32": torch.float32,
    "int64": torch.int64,
    "bool": torch.bool,
    "bfloat16": torch.bfloat16,
}
OPS = {
    "SUM": (ReduceOp.SUM, torch.add),
    "AVG": (ReduceOp.AVG, torch.add),
    "PRODUCT": (ReduceOp.PRODUCT, torch.mul),
    "MIN": (ReduceOp.MIN, torch.minimum),
    "MAX": (ReduceOp.MAX, torch.maximum),
    "BAND": (ReduceOp.BAND, torch.bitwise_and),
    "BOR": (ReduceOp.BOR, torch.bitwise_or),
    "BXOR": (ReduceOp.BXOR, torch.bitwise_xor),
}
ALLOWED = {
    "float32": ("SUM", "AVG", "PRODUCT", "MIN", "MAX"),
    "int64": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
    "bool": ("MIN", "MAX", "BAND", "BOR", "BXOR"),
    "bfloat16": ("SUM",),
}
SIZES = (1, 7, 1003)
Results = list[tuple[str, bool, str]]


def value(rank: int, n: int, dtype: str, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s deterministic input: small integers (exact in every dtype here)."""
    i = torch.arange(n, dtype=torch.int64) + 13 * salt
    if dtype == "bool":
        return (i + rank) % 3 == 0
    if dtype == "int64":
        return (i * 37 + rank * 11) % 64 - 20
    return ((i * 7 + rank * 3) % 5 + 1).to(DTYPES[dtype])


def reduced(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    """The reduction of ``xs`` computed locally (AVG: sum, then divide)."""
    out = functools.reduce(OPS[op][1], xs)
    return out / len(xs) if op == "AVG" else out


def _diff(got: Any, want: Any) -> str:
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
        bad = (got != want).nonzero().flatten().tolist()[:3]
        return f"first mismatches at {bad}: got {got[bad].tolist()}, want {want[bad].tolist()}"
    return f"got {got!r}, want {want!r}"


class Table:
    """Collects (case, ok, detail) on one rank; a raising case is recorded, not propagated."""

    def __init__(self) -> None:
        self.results: Results = []

    def check(self, case: str, got: Any, want: Any) -> None:
        if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
            ok = got.dtype == want.dtype and torch.equal(got, want)
        else:
            ok = bool(got == want)
        self.results.append((case, ok, "" if ok else _diff(got, want)))

    def run(self, case: str, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(self, *args)
        except Exception as exc:  # record and go on: the other ranks raise the same
            self.results.append((case, False, f"{type(exc).__name__}: {exc}"[:400]))


def _reductions(t: Table, rank: int, ws: int, dt: str, op: str, n: int) -> None:
    rop = OPS[op][0]
    inputs = [value(r, n, dt) for r in range(ws)]
    want = reduced(op, inputs)
    got = {}
    for alg in ("native", "ring", "tree"):
        x = value(rank, n, dt)
        phalanx.all_reduce(x, rop, algorithm=alg)
        t.check(f"all_reduce/{alg}/{op}/{dt}/n={n}", x, want)
        got[alg] = x
    t.check(f"all_reduce/ring==native/{op}/{dt}/n={n}", got["ring"], got["native"])
    t.check(f"all_reduce/tree==native/{op}/{dt}/n={n}", got["tree"], got["native"])
    x = value(rank, n, dt)
    phalanx.reduce(x, ws - 1, rop)
    if rank == ws - 1:
        t.check(f"reduce/{op}/{dt}/n={n}", x, want)
    _reduce_scatters(t, rank, ws, dt, op, n)


def _reduce_scatters(t: Table, rank: int, ws: int, dt: str, op: str, n: int) -> None:
    rop = OPS[op][0]
    full = [value(r, n * ws, dt) for r in range(ws)]
    want = reduced(op, full)[rank * n : (rank + 1) * n]
    out = torch.empty(n, dtype=DTYPES[dt])
    phalanx.reduce_scatter(out, list(value(rank, n * ws, dt).chunk(ws)), rop)
    t.check(f"reduce_scatter/{op}/{dt}/n={n}", out, want)
    for name, fn in (
        ("reduce_scatter_tensor", phalanx.reduce_scatter_tensor),
        ("ring_reduce_scatter", algorithms.ring_reduce_scatter),
    ):
        inp = value(rank, n * ws, dt)
        out = torch.empty(n, dtype=DTYPES[dt])
        fn(out, inp, rop)
        t.check(f"{name}/{op}/{dt}/n={n}", out, want)
        t.check(f"{name}/input-unchanged/{op}/{dt}/n={n}", inp, value(rank, n * ws, dt))


def _movement(t: Table, rank: int, ws: int, dt: str, n: int) -> None:
    """Collectives that only move data: broadcast, gathers, scatter, all-to-all."""
    root = ws - 1
    dtype = DTYPES[dt]
    for name, fn in (
        ("broadcast", phalanx.broadcast),
        ("tree_broadcast", algorithms.tree_broadcast),
        ("ring_broadcast", algorithms.ring_broadcast),
    ):
        x = value(rank, n, dt)
        fn(x, root)
        t.check(f"{name}/{dt}/n={n}", x, value(root, n, dt))
    every = [value(r, n, dt) for r in range(ws)]
    outs = [torch.empty(n, dtype=dtype) for _ in range(ws)]
    phalanx.all_gather(outs, value(rank, n, dt))
    t.check(f"all_gather/{dt}/n={n}", torch.cat(outs), torch.cat(every))
    for name, fn in (
        ("all_gather_into_tensor", phalanx.all_gather_into_tensor),
        ("ring_all_gather", algorithms.ring_all_gather),
    ):
        out = torch.empty(n * ws, dtype=dtype)
        fn(out, value(rank, n, dt))
        t.check(f"{name}/{dt}/n={n}", out, torch.cat(every))
    gl = [torch.empty(n, dtype=dtype) for _ in range(ws)] if rank == root else None
    phalanx.gather(value(rank, n, dt), gl, root)
    if gl is not None:
        t.check(f"gather/{dt}/n={n}", torch.cat(gl), torch.cat(every))
    sl = [value(r, n, dt, salt=root) for r in range(ws)] if rank == root else None
    out = torch.empty(n, dtype=dtype)
    phalanx.scatter(out, sl, root)
    t.check(f"scatter/{dt}/n={n}", out, value(rank, n, dt, salt=root))
    _all_to_all(t, rank, ws, dt, n)


def _all_to_all(t: Table, rank: int, ws: int, dt: str, n: int) -> None:
    # rank s sends piece(s, d) to rank d: distinct contents, and sizes n + s + d for the
    # uneven all_to_all_single (gloo's list all_to_all needs equal sizes)
    def piece(src: int, dst: int, size: int) -> torch.Tensor:
        return value(src, size, dt, salt=dst)

    outs = [torch.empty(n, dtype=DTYPES[dt]) for _ in range(ws)]
    phalanx.all_to_all(outs, [piece(rank, j, n) for j in range(ws)])
    want = torch.cat([piece(r, rank, n) for r in range(ws)])
    t.check(f"all_to_all/{dt}/n={n}", torch.cat(outs), want)
    sizes_in = [n + rank + j for j in range(ws)]
    sizes_out = [n + r + rank for r in range(ws)]
    out = torch.empty(sum(sizes_out), dtype=DTYPES[dt])
    send = torch.cat([piece(rank, j, k) for j, k in enumerate(sizes_in)])
    phalanx.all_to_all_single(out, send, sizes_out, sizes_in)
    want = torch.cat([piece(r, rank, k) for r, k in enumerate(sizes_out)])
    t.check(f"all_to_all_single/uneven/{dt}/n={n}", out, want)
    even = torch.empty(n * ws, dtype=DTYPES[dt])
    phalanx.all_to_all_single(even, value(rank, n * ws, dt))
    want = torch.cat([value(r, n * ws, dt)[rank * n : (rank + 1) * n] for r in range(ws)])
    t.check(f"all_to_all_single/even/{dt}/n={n}", even, want)


def _point_to_point(t: Table, rank: int, ws: int) -> None:
    right, left = (rank + 1) % ws, (rank - 1) % ws
    got = torch.empty(7, dtype=torch.int64)
    if rank % 2 == 0:
        phalanx.send(value(rank, 7, "int64"), right)
        sender = phalanx.recv(got, None)  # any source: only the left one sends here
    else:
        sender = phalanx.recv(got, left)
        phalanx.send(value(rank, 7, "int64"), right)
    t.check("send/recv", got, value(left, 7, "int64"))
    t.check("recv/returns-sender", sender, left)
    buf = torch.empty(1003)
    works = [phalanx.isend(value(rank, 1003, "float32"), right), phalanx.irecv(buf, left)]
    for w in works:
        w.wait()
    t.check("isend/irecv", buf, value(left, 1003, "float32"))
    phalanx.barrier()
    t.check("barrier", True, True)


def _objects(t: Table, rank: int, ws: int) -> None:
    obj = lambda r: {"rank": r, "name": f"r{r}", "t": torch.arange(r + 1), "nested": [r, (r,)]}  # noqa: E731
    same = lambda a, b: repr(a) == repr(b)  # noqa: E731  (tensors compare elementwise)
    objs: list[Any] = [None] * ws
    phalanx.all_gather_object(objs, obj(rank))
    t.check("all_gather_object", same(objs, [obj(r) for r in range(ws)]), True)
    lst = [obj(rank), "x" * rank] if rank == ws - 1 else [None, None]
    phalanx.broadcast_object_list(lst, src=ws - 1)
    t.check("broadcast_object_list", same(lst, [obj(ws - 1), "x" * (ws - 1)]), True)
    gathered: list[Any] | None = [None] * ws if rank == ws - 1 else None
    phalanx.gather_object(obj(rank), gathered, dst=ws - 1)
    if gathered is not None:
        t.check("gather_object", same(gathered, [obj(r) for r in range(ws)]), True)
    out: list[Any] = [None]
    phalanx.scatter_object_list(out, [obj(10 + r) for r in range(ws)] if rank == 0 else None, 0)
    t.check("scatter_object_list", same(out[0], obj(10 + rank)), True)


def table_rank() -> Results:
    """Run every case on this rank (called by ``run_distributed``)."""
    rank, ws = phalanx.world().rank, phalanx.world().world_size
    t = Table()
    for dt, ops in ALLOWED.items():
        for n in SIZES:
            for op in ops:
                t.run(f"reductions/{op}/{dt}/n={n}", _reductions, rank, ws, dt, op, n)
            t.run(f"movement/{dt}/n={n}", _movement, rank, ws, dt, n)
    t.run("point_to_point", _point_to_point, rank, ws)
    t.run("objects", _objects, rank, ws)
    return t.results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_table(world_size: int) -> None:
    per_rank = run_distributed(table_rank, world_size=world_size, timeout=120)
    failures = [
        f"rank {rank}: {case}: {detail}"
        for rank, results in enumerate(per_rank)
        for case, ok, detail in results
        if not ok
    ]
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:40])
    counts = {len(r) for r in per_rank[:1]}
    assert counts and min(counts) > 300, f"too few cases ran: {counts}"
