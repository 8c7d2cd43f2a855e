"""backend="shm" against gloo on the same ranks: every collective, reduce op, dtype and size.

One job per world size runs every case on the default group (shm) and on a gloo group over the
same ranks, from the same inputs, and returns the cases whose results differ. Integers, bool,
MIN and MAX must be identical; floating SUM / PRODUCT / AVG too wherever the order of the
additions is the same (always at two ranks; at three and four ranks the ranks' own reference in rank
order is the exact target, and gloo, whose ring adds in another order, agrees within rounding).
A 64 KiB slot makes the larger sizes go through in several chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from phalanx.comm.shm.ops import op_name
from phalanx.testing import run_distributed

RED = dist.ReduceOp.RedOpType
DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
OPS = [RED.SUM, RED.PRODUCT, RED.MIN, RED.MAX, RED.BAND, RED.BOR, RED.BXOR, RED.AVG]
SIZES = [0, 1, 7, 1003, 40_003]
SLOT = {"PHALANX_SHM_SLOT_MB": "0.0625"}


def _valid(op: RED, dtype: torch.dtype) -> bool:
    if op in (RED.BAND, RED.BOR, RED.BXOR):
        return not dtype.is_floating_point
    return op != RED.AVG or dtype.is_floating_point


def _data(rank: int, dtype: torch.dtype, n: int, seed: int, op: RED = RED.SUM) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        scale = 1.0 if op == RED.PRODUCT else 100.0
        return (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
    low, high = (-3, 4) if op == RED.PRODUCT else (-100, 100)
    if dtype == torch.uint8:
        low, high = (0, 4) if op == RED.PRODUCT else (0, 256)
    return torch.randint(low, high, (n,), generator=g, dtype=dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:  # NaN-free inputs; compare the bits
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _exact(op: RED, dtype: torch.dtype, world: int) -> bool:
    """Does gloo's result equal ours bit for bit (same order of operations, or no rounding)?"""
    return world == 2 or not dtype.is_floating_point or op in (RED.MIN, RED.MAX)


def _close(ours: torch.Tensor, gloo: torch.Tensor, world: int) -> bool:
    """Equal up to a few roundings of the inputs' magnitude (100) in the dtype."""
    atol = 4 * world * 100 * torch.finfo(ours.dtype).eps
    return torch.allclose(ours.double(), gloo.double(), rtol=1e-2, atol=atol)


def _rank_order(inputs: list[torch.Tensor], op: RED) -> torch.Tensor:
    fn: Callable[..., torch.Tensor] = {
        RED.SUM: torch.add,
        RED.AVG: torch.add,
        RED.PRODUCT: torch.mul,
        RED.MIN: torch.minimum,
        RED.MAX: torch.maximum,
    }[op]
    out = inputs[0].clone()
    for t in inputs[1:]:
        out = fn(out, t)
    return out / len(inputs) if op == RED.AVG else out


class _Cases:
    def __init__(self) -> None:
        self.gloo = dist.new_group(backend="gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.failures: list[str] = []
        self.count = 0

    def both(self, name: str, run: Callable[[object], torch.Tensor], exact: bool) -> None:
        """Run ``run(group)`` on shm and on gloo; record ``name`` when the results differ."""
        self.count += 1
        ours, theirs = run(None), run(self.gloo)
        equal = _same(ours, theirs) if exact else _close(ours, theirs, self.world)
        if not equal:
            self.failures.append(f"{name}: shm {ours[:4].tolist()} gloo {theirs[:4].tolist()}")

    def expect(self, name: str, ours: torch.Tensor, reference: torch.Tensor) -> None:
        if not _same(ours, reference):
            self.failures.append(f"{name}: shm {ours[:4].tolist()} ref {reference[:4].tolist()}")


def _all_reduce_cases(c: _Cases) -> None:
    for op in OPS:
        for dtype in DTYPES:
            if not _valid(op, dtype):
                continue
            for n in SIZES:
                seed = hash((int(op), str(dtype), n)) % 10_000

                def run(
                    group: object,
                    op: RED = op,
                    dtype: torch.dtype = dtype,
                    n: int = n,
                    seed: int = seed,
                ) -> torch.Tensor:
                    t = _data(c.rank, dtype, n, seed, op)
                    dist.all_reduce(t, op=dist.ReduceOp(op), group=group)
                    return t

                name = f"all_reduce {op_name(int(op))} {dtype} n={n}"
                c.both(name, run, _exact(op, dtype, c.world))
                if dtype.is_floating_point and op not in (RED.MIN, RED.MAX):
                    inputs = [_data(r, dtype, n, seed, op) for r in range(c.world)]
                    c.expect(name + " (rank order)", run(None), _rank_order(inputs, op))


def _rooted_cases(c: _Cases) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        for n in (0, 5, 40_003):
            for root in (0, c.world - 1):

                def bcast(
                    group: object, dtype: torch.dtype = dtype, n: int = n, root: int = root
                ) -> torch.Tensor:
                    t = _data(c.rank, dtype, n, 7)
                    dist.broadcast(t, root, group=group)
                    return t

                c.both(f"broadcast {dtype} n={n} root={root}", bcast, True)
                for op in (RED.SUM, RED.MAX):

                    def reduce(
                        group: object,
                        dtype: torch.dtype = dtype,
                        n: int = n,
                        root: int = root,
                        op: RED = op,
                    ) -> torch.Tensor:
                        t = _data(c.rank, dtype, n, 8)
                        dist.reduce(t, root, op=dist.ReduceOp(op), group=group)
                        return t if c.rank == root else t[:0]  # elsewhere: undefined

                    name = f"reduce {op_name(int(op))} {dtype} n={n} root={root}"
                    c.both(name, reduce, _exact(op, dtype, c.world))


def _gather_cases(c: _Cases) -> None:
    w = c.world
    for dtype in (torch.float16, torch.int32, torch.uint8, torch.bool):
        for n in (0, 1, 7, 40_003):

            def into(group: object, dtype: torch.dtype = dtype, n: int = n) -> torch.Tensor:
                out = torch.empty(w * n, dtype=dtype)
                dist.all_gather_into_tensor(out, _data(c.rank, dtype, n, 9), group=group)
                return out

            def listed(group: object, dtype: torch.dtype = dtype, n: int = n) -> torch.Tensor:
                outs = [torch.empty(n, dtype=dtype) for _ in range(w)]
                dist.all_gather(outs, _data(c.rank, dtype, n, 10), group=group)
                return torch.cat(outs)

            c.both(f"all_gather_into_tensor {dtype} n={n}", into, True)
            c.both(f"all_gather {dtype} n={n}", listed, True)


def _reduce_scatter_cases(c: _Cases) -> None:
    w = c.world
    for op in OPS:
        for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.int64, torch.bool):
            if not _valid(op, dtype):
                continue
            for n in (0, 1, 13, 20_001):

                def rs(
                    group: object, op: RED = op, dtype: torch.dtype = dtype, n: int = n
                ) -> torch.Tensor:
                    out = torch.empty(n, dtype=dtype)
                    inp = _data(c.rank, dtype, w * n, 11, op)
                    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp(op), group=group)
                    return out

                name = f"reduce_scatter_tensor {op_name(int(op))} {dtype} n={n}"
                c.both(name, rs, _exact(op, dtype, c.world))
                if op == RED.SUM and n and _exact(op, dtype, w):  # list form, vs gloo tensor form
                    inp = _data(c.rank, dtype, w * n, 11, op)
                    out = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter(out, list(inp.split(n)))
                    c.expect(f"reduce_scatter {dtype} n={n}", out, rs(c.gloo))


def _all_to_all_cases(c: _Cases) -> None:
    w, r = c.world, c.rank
    for dtype in (torch.float32, torch.int64):
        for rows in (0, w, 3 * w):

            def even(group: object, dtype: torch.dtype = dtype, rows: int = rows) -> torch.Tensor:
                inp = _data(r, dtype, rows * 3, 12).view(rows, 3)
                out = torch.empty_like(inp)
                dist.all_to_all_single(out, inp, group=group)
                return out.view(-1)

            c.both(f"all_to_all_single {dtype} rows={rows}", even, True)
        # uneven: rank s sends (s + d) % 3 * 9001 rows to rank d: crosses the 64 KiB slot
        sends = [(r + d) % 3 * 9001 for d in range(w)]
        recvs = [(s + r) % 3 * 9001 for s in range(w)]

        def uneven(
            group: object,
            dtype: torch.dtype = dtype,
            sends: list[int] = sends,
            recvs: list[int] = recvs,
        ) -> torch.Tensor:
            inp = _data(r, dtype, sum(sends), 13)
            out = torch.empty(sum(recvs), dtype=dtype)
            dist.all_to_all_single(out, inp, recvs, sends, group=group)
            return out

        c.both(f"all_to_all_single uneven {dtype}", uneven, True)


def _every_case() -> tuple[int, list[str]]:
    c = _Cases()
    _all_reduce_cases(c)
    _rooted_cases(c)
    _gather_cases(c)
    _reduce_scatter_cases(c)
    _all_to_all_cases(c)
    dist.barrier()
    return c.count, c.failures


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_collective_matches_gloo(world_size: int) -> None:
    results = run_distributed(
        _every_case, world_size=world_size, backend="shm", timeout=120, env=SLOT
    )
    for count, failures in results:
        assert count > 400
        assert failures == [], "\n".join(failures)


def _large() -> bool:
    t = torch.full((16 << 20,), float(dist.get_rank() + 1))  # 64 MiB of float32
    dist.all_reduce(t)
    return bool((t == 3.0).all())


def test_64_mib_all_reduce() -> None:
    assert run_distributed(_large, world_size=2, backend="shm", timeout=60) == [True, True]
