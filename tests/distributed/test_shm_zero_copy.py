"""Buffers in the shm group's shared memory: collectives on them copy nothing, and equal gloo.

Each case fills this rank's shared buffer (or a slice of it) with the same data as a plain
tensor that goes through gloo; at two ranks the results must be equal bit for bit (the sums are
a + b either way), at three ranks equal to a reduction in rank order. The backend's
``zero_copy_calls`` counter proves the zero-copy path ran. phalanx's DDP on shm (buckets in
shared buffers) is tested in ``test_shm_backend.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.comm.errors import CollectiveMismatchError
from phalanx.comm.shm import shared_buffer
from phalanx.testing import run_distributed

RED = dist.ReduceOp.RedOpType
CASES = [
    (torch.float32, RED.SUM),
    (torch.float32, RED.AVG),
    (torch.bfloat16, RED.SUM),
    (torch.float64, RED.PRODUCT),
    (torch.int64, RED.MAX),
    (torch.int32, RED.BXOR),
]
SIZES = [1, 7, 40_003, 300_001]


def _data(rank: int, dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-100, 100, (n,), generator=g, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.is_floating_point else t


def _reference(
    gloo: Any, fn: str, world: int, dtype: torch.dtype, n: int, op: Any, seed: int
) -> torch.Tensor:
    """gloo's result at two ranks; a rank-order reduction of everyone's data at more."""
    rank = dist.get_rank()
    if fn == "all_gather":
        return torch.cat([_data(r, dtype, n, seed) for r in range(world)])
    if world == 2:
        t = _data(rank, dtype, n if fn == "all_reduce" else 2 * n, seed)
        if fn == "all_reduce":
            dist.all_reduce(t, op=dist.ReduceOp(op), group=gloo)
            return t
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, t, op=dist.ReduceOp(op), group=gloo)
        return out
    inputs = [_data(r, dtype, n if fn == "all_reduce" else world * n, seed) for r in range(world)]
    if fn == "reduce_scatter":
        inputs = [t[rank * n : (rank + 1) * n] for t in inputs]
    fold = {RED.SUM: torch.add, RED.AVG: torch.add, RED.PRODUCT: torch.mul}
    out = inputs[0].clone()
    for t in inputs[1:]:
        out = fold[op](out, t) if op in fold else _other(op, out, t)
    return out / world if op == RED.AVG else out


def _other(op: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.maximum(a, b) if op == RED.MAX else torch.bitwise_xor(a, b)


def _cases() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    gloo = dist.new_group(backend="gloo")
    failures, runs = [], 0
    for dtype, op in CASES:
        for n in SIZES:
            seed = n + 7 * int(op)
            # all_reduce on a slice 3 elements into the buffer (an offset), in place
            buf = shared_buffer(None, n + 5, dtype)
            t = buf[3 : 3 + n]
            t.copy_(_data(rank, dtype, n, seed))
            dist.all_reduce(t, op=dist.ReduceOp(op))
            ref = _reference(gloo, "all_reduce", world, dtype, n, op, seed)
            if not torch.equal(_bits(t), _bits(ref)):
                failures.append(f"all_reduce {dtype} {op} n={n}")
            # reduce_scatter_tensor from a shared input into a plain output
            inp = shared_buffer(None, world * n, dtype)
            inp.copy_(_data(rank, dtype, world * n, seed))
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp(op))
            ref = _reference(gloo, "reduce_scatter", world, dtype, n, op, seed)
            if not torch.equal(_bits(out), _bits(ref)):
                failures.append(f"reduce_scatter {dtype} {op} n={n}")
            runs += 2
        # all_gather_into_tensor in place: the input is this rank's block of the output
        for n in SIZES:
            whole = shared_buffer(None, world * n, dtype)
            mine = whole[rank * n : (rank + 1) * n]
            mine.copy_(_data(rank, dtype, n, n))
            dist.all_gather_into_tensor(whole, mine)
            if not torch.equal(
                _bits(whole), _bits(_reference(gloo, "all_gather", world, dtype, n, op, n))
            ):
                failures.append(f"all_gather {dtype} n={n}")
            runs += 1
    dist.barrier()
    return {"failures": failures, "runs": runs, "zero_copy": pg.zero_copy_calls}  # type: ignore[attr-defined]


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_on_shared_buffers_match_gloo_and_copy_nothing(world_size: int) -> None:
    results = run_distributed(_cases, world_size=world_size, backend="shm", timeout=120)
    for res in results:
        assert res["failures"] == [], res["failures"]
        assert res["runs"] == len(CASES) * len(SIZES) * 3
        assert res["zero_copy"] == res["runs"]


def _mixed_and_errors() -> dict[str, str]:
    rank = dist.get_rank()
    out: dict[str, str] = {}
    buf = shared_buffer(None, 8)
    try:  # rank 0's tensor is shared, rank 1's is not: a mismatch on both, naming the buffer
        dist.all_reduce(buf if rank == 0 else torch.zeros(8))
    except CollectiveMismatchError as exc:
        out["mixed"] = str(exc)
    buf.fill_(rank + 1)
    dist.all_reduce(buf)  # the group still works
    out["after"] = str(buf.tolist())
    for name, call in (
        ("gloo", lambda: shared_buffer(dist.new_group(backend="gloo"), 8)),
        ("numel", lambda: shared_buffer(None, 0)),
        ("dtype", lambda: shared_buffer(None, 8, torch.complex64)),
        ("unlike", lambda: shared_buffer(None, 8 + rank)),
    ):
        try:
            call()
        except (ValueError, TypeError) as exc:
            out[name] = str(exc)
    again = shared_buffer(None, 4)  # the group still allocates after a refusal
    again.fill_(rank + 1)
    dist.all_reduce(again)
    out["again"] = str(again.tolist())
    paths = dist.distributed_c10d._get_default_group()._regions.paths  # type: ignore[attr-defined]
    out["unlinked"] = str(len(paths) == 2 and not any(map(os.path.exists, paths)))
    return out


def test_mixed_calls_and_bad_arguments_are_refused() -> None:
    res = run_distributed(_mixed_and_errors, world_size=2, backend="shm", timeout=60)
    for r in res:
        assert "in shared buffer #1" in r["mixed"], r
        assert r["after"] == str([3.0] * 8) and r["again"] == str([3.0] * 4)
        assert "backend 'gloo'" in r["gloo"] and "backend='shm'" in r["gloo"]
        assert "numel must be a positive int, got 0" in r["numel"]
        assert "complex64" in r["dtype"]
        assert "rank 0 8 x float32, rank 1 9 x float32" in r["unlike"]
        assert r["unlinked"] == "True"  # two buffers made, neither left in /dev/shm
