"""Ring and tree algorithms on real gloo ranks: pipelining, layouts, subgroups, errors, 1 rank.

Inputs are small integers (exact in float32), so results must equal native bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import phalanx
from phalanx.comm import algorithms as alg
from phalanx.comm import ring
from phalanx.testing import run_distributed


def _input(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = int(torch.tensor(shape).prod()) if shape else 1
    return ((torch.arange(n) * 7 + rank * 5) % 11 - 3).to(dtype).reshape(shape)


def _native_all_reduce(x: torch.Tensor, op: Any, group: Any = None) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y, op, group)
    return y


def _all_shapes_and_ops(piece_bytes: int) -> list[str]:
    """Every algorithm vs native on awkward sizes, with ``piece_bytes`` pieces; return failures."""
    ring.PIECE_BYTES = piece_bytes
    rank, ws = dist.get_rank(), dist.get_world_size()
    bad = []
    for shape in [(), (0,), (1,), (5,), (17,), (3, 41), (1003,)]:
        for dtype, op in [
            (torch.float32, ReduceOp.SUM),
            (torch.int64, ReduceOp.MAX),
            (torch.int64, ReduceOp.BXOR),
            (torch.float32, ReduceOp.AVG),
        ]:
            want = _native_all_reduce(_input(rank, shape, dtype), op)
            for fn in (alg.ring_all_reduce, alg.tree_all_reduce):
                got = _input(rank, shape, dtype)
                fn(got, op)
                if not torch.equal(got, want):
                    bad.append(f"{fn.__name__} {op.name} {dtype} {shape}")
        n = shape[0] if shape else 1
        full, out, want_rs = _input(rank, (n * ws,)), torch.empty(n), torch.empty(n)
        dist.reduce_scatter_single(want_rs, full.clone())
        alg.ring_reduce_scatter(out, full)
        if not torch.equal(out, want_rs):
            bad.append(f"ring_reduce_scatter {shape}")
        gathered = torch.empty(n * ws)
        alg.ring_all_gather(gathered, _input(rank, (n,)))
        if not torch.equal(gathered, torch.cat([_input(r, (n,)) for r in range(ws)])):
            bad.append(f"ring_all_gather {shape}")
        for src in range(ws):
            for fn in (alg.tree_broadcast, alg.ring_broadcast):
                t = _input(rank, shape)
                fn(t, src)
                if not torch.equal(t, _input(src, shape)):
                    bad.append(f"{fn.__name__} src={src} {shape}")
    return bad


@pytest.mark.parametrize(("world_size", "piece_bytes"), [(2, 64), (3, 32), (4, 128), (3, 1 << 20)])
def test_equal_native_with_many_pipelined_pieces(world_size: int, piece_bytes: int) -> None:
    per_rank = run_distributed(_all_shapes_and_ops, piece_bytes, world_size=world_size)
    assert per_rank == [[]] * world_size


def _non_contiguous() -> list[bool]:
    rank = dist.get_rank()
    base = _input(rank, (6, 7)).t()  # a transposed view: not contiguous
    want = _native_all_reduce(base.contiguous(), ReduceOp.SUM)
    results = []
    for fn in (alg.ring_all_reduce, alg.tree_all_reduce):
        x = base.clone().t().contiguous().t()  # same layout as base
        assert not x.is_contiguous()
        fn(x, ReduceOp.SUM)
        results.append(torch.equal(x, want))
    out = torch.empty(4, 6).t()
    alg.ring_all_gather(out, _input(rank, (3, 4)).t())
    want_ag = torch.cat([_input(r, (3, 4)).t().reshape(-1) for r in range(2)])
    results.append(torch.equal(out.reshape(-1), want_ag))
    return results


def test_non_contiguous_tensors() -> None:
    assert run_distributed(_non_contiguous) == [[True] * 3] * 2


def _large() -> bool:
    rank = dist.get_rank()
    x = _input(rank, (5 * (1 << 19) + 5,))  # 10 MiB: 5 MiB chunks, two default pieces each
    want = _native_all_reduce(x, ReduceOp.SUM)
    ok = True
    for algorithm in ("ring", "tree"):
        y = x.clone()
        phalanx.all_reduce(y, algorithm=algorithm)
        ok &= torch.equal(y, want)
    return ok


def test_large_tensor_through_phalanx_all_reduce() -> None:
    assert run_distributed(_large) == [True, True]


def _subgroup() -> Any:
    rank = dist.get_rank()
    group = dist.new_group([1, 2, 3])
    x = _input(rank, (10,))
    if rank == 0:  # not a member: like torch, nothing happens
        alg.ring_all_reduce(x, group=group)
        alg.tree_broadcast(x, 3, group=group)
        return torch.equal(x, _input(0, (10,)))
    want = sum(_input(r, (10,)) for r in (1, 2, 3))
    results = []
    for fn in (alg.ring_all_reduce, alg.tree_all_reduce):
        y = x.clone()
        fn(y, ReduceOp.SUM, group)
        results.append(torch.equal(y, want))
    for src in (1, 3):  # global ranks, as in torch
        for fn in (alg.tree_broadcast, alg.ring_broadcast):
            y = x.clone()
            fn(y, src, group)
            results.append(torch.equal(y, _input(src, (10,))))
    out = torch.empty(30)
    alg.ring_all_gather(out, x, group)
    results.append(torch.equal(out, torch.cat([_input(r, (10,)) for r in (1, 2, 3)])))
    try:
        alg.tree_broadcast(x, 0, group)
    except ValueError as exc:
        results.append("src=0" in str(exc))
    return all(results)


def test_subgroup_uses_group_ranks() -> None:
    assert run_distributed(_subgroup, world_size=4) == [True] * 4


def _errors() -> list[str]:
    messages = []
    calls = [
        lambda: alg.ring_all_reduce(torch.ones(3), ReduceOp.BAND),
        lambda: alg.tree_all_reduce(torch.ones(3, dtype=torch.bfloat16), ReduceOp.BOR),
        lambda: phalanx.all_reduce(
            torch.ones(3, dtype=torch.int64), ReduceOp.AVG, None, False, algorithm="ring"
        ),
        lambda: alg.tree_all_reduce(torch.ones(3), ReduceOp.PREMUL_SUM),
        lambda: alg.ring_reduce_scatter(torch.empty(2), torch.ones(5)),
        lambda: alg.ring_all_gather(torch.empty(4), torch.ones(2, dtype=torch.int64)),
        lambda: alg.ring_broadcast(torch.ones(2), 7),
    ]
    for call in calls:
        try:
            call()
            messages.append("no error")
        except (TypeError, ValueError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    t = torch.ones(2)
    phalanx.all_reduce(t)  # nothing half-sent is left behind
    messages.append(str(t.tolist()))
    return messages


def test_errors_name_the_op_dtype_and_sizes_on_every_rank() -> None:
    per_rank = run_distributed(_errors)
    assert per_rank[0] == per_rank[1]
    m = per_rank[0]
    assert m[0].startswith("TypeError") and "BAND" in m[0] and "torch.float32" in m[0]
    assert m[1].startswith("TypeError") and "BOR" in m[1] and "torch.bfloat16" in m[1]
    assert m[2].startswith("TypeError") and "AVG" in m[2] and "torch.int64" in m[2]
    assert m[3].startswith("ValueError") and "PREMUL_SUM" in m[3]
    assert m[4].startswith("ValueError") and "input" in m[4] and "5" in m[4] and "2" in m[4]
    assert m[5].startswith("TypeError") and "torch.float32" in m[5] and "torch.int64" in m[5]
    assert m[6].startswith("ValueError") and "src=7" in m[6]
    assert m[7] == "[2.0, 2.0]"


def _single_rank() -> list[bool]:
    ok = []
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN):
        for fn in (alg.ring_all_reduce, alg.tree_all_reduce):
            x = _input(0, (7,))
            fn(x, op)
            ok.append(torch.equal(x, _input(0, (7,))))
    out = torch.empty(7)
    alg.ring_reduce_scatter(out, _input(0, (7,)), ReduceOp.AVG)
    ok.append(torch.equal(out, _input(0, (7,))))
    alg.ring_all_gather(out, _input(0, (7,)) + 1)
    ok.append(torch.equal(out, _input(0, (7,)) + 1))
    alg.tree_broadcast(out, 0)
    ok.append(torch.equal(out, _input(0, (7,)) + 1))
    try:
        alg.ring_all_reduce(torch.ones(2), ReduceOp.BXOR)
        ok.append(False)
    except TypeError:
        ok.append(True)
    return ok


def test_world_size_one_is_the_identity() -> None:
    assert all(run_distributed(_single_rank, world_size=1)[0])


def _user_message_in_flight() -> bool:
    rank = dist.get_rank()
    mine = torch.full((3,), 7.0) if rank == 0 else torch.zeros(3)
    work = dist.isend(mine, 1) if rank == 0 else None  # the user's own P2P, not yet received
    x = _input(rank, (9,))
    alg.ring_all_reduce(x)
    alg.tree_all_reduce(x)
    ok = torch.equal(x, 2 * (_input(0, (9,)) + _input(1, (9,))))
    if rank == 1:
        dist.recv(mine, 0)
        ok &= mine.tolist() == [7.0] * 3
    elif work is not None:
        work.wait()
    return ok


def test_user_messages_in_flight_are_not_taken() -> None:
    assert run_distributed(_user_message_in_flight) == [True, True]


def _with_validation() -> list[float]:
    t = torch.full((5,), float(dist.get_rank() + 1))
    phalanx.all_reduce(t, algorithm="tree")
    phalanx.all_reduce(t, ReduceOp.AVG, algorithm="ring")
    return t.tolist()


def test_tracked_and_validated_through_phalanx() -> None:
    assert run_distributed(_with_validation, validate=True) == [[3.0] * 5] * 2
