"""``phalanx bench comm``: the backend's collectives against phalanx's ring and tree algorithms.

For each operation and message size every rank runs the implementations interleaved
(native, ring, tree, then ring, tree, native, ...), each after a barrier, timing it with
``time.perf_counter``; an iteration's time is the slowest rank's (a MAX all-reduce after the
timed region). Rank 0 prints each size's rows as they are measured (and appends them to
``rows.jsonl`` in ``--out``); the parent then prints p50/p90 latency and bandwidths as nccl-tests
defines them:
``algbw = bytes / time`` and ``busbw = algbw * factor`` with factor ``2 (n - 1) / n`` for
all-reduce, ``(n - 1) / n`` for reduce-scatter and all-gather (bytes = the whole gathered
buffer) and 1 for broadcast, so busbw is comparable across world sizes. The last line is
``RESULT {json}``.

``--shm`` compares gloo (``native``), the shared-memory backend with copy-in (``shm``) and with
buffers already in shared memory (``shm-buffers``), and a ``copy_`` of the same bytes
(``memcpy``) instead, in one interleaved run (``comm_shm.py``); rows then also carry
``vs_memcpy``.

Run it with ``python -m phalanx.bench.comm [flags]`` or ``phalanx bench comm [flags]``.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, NoReturn

from phalanx.bench.comm_shm import MEMCPY, ShmBench, shm_impls
from phalanx.bench.comm_table import GiB, KiB, MiB, Row, format_bytes, format_table
from phalanx.bench.common import Output, add_common_flags

__all__ = [
    "BenchConfig",
    "Row",
    "busbw_factor",
    "format_bytes",
    "format_table",
    "main",
    "parse_args",
    "size_list",
    "summarize",
]

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
SHARDED = ("reduce_scatter", "all_gather")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB}


class BenchArgsError(ValueError):
    """A flag of ``phalanx bench comm`` has an unusable value (exit code 2)."""


@dataclass(frozen=True)
class BenchConfig:
    """What to measure, validated."""

    world_size: int = 2
    """Number of ranks (gloo processes on this machine)."""
    ops: tuple[str, ...] = OPS
    """Operations to measure, in order."""
    sizes: tuple[int, ...] = ()
    """Message sizes in bytes (for reduce-scatter / all-gather: the whole gathered buffer)."""
    iters: int = 20
    """Timed iterations of each implementation per size."""
    warmup: int = 3
    """Untimed iterations first."""
    dtype: str = "float32"
    """Element type of the buffers."""
    json_path: str | None = None
    """Also write the result to this file."""
    out: str | None = None
    """Directory for the results (None: a new one under ``runs/``)."""
    shm: bool = False
    """Compare gloo, shm (copy-in), shm with shared buffers and memcpy (``comm_shm.py``)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise BenchArgsError(message)


def parse_bytes(flag: str, raw: str) -> int:
    """``"64MiB"``, ``"4K"``, ``"1024"`` -> bytes; raises naming ``flag`` and ``raw``."""
    text = raw.strip().lower()
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits) :]
    if not digits.isdigit() or unit not in UNITS:
        raise BenchArgsError(f"{flag} {raw!r} is not a size in bytes (e.g. 4, 64KiB, 16MiB)")
    value = int(digits) * UNITS[unit]
    if value < 1:
        raise BenchArgsError(f"{flag} {raw!r} is invalid: it must be at least 1 byte")
    return value


def size_list(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """``min_bytes``, then times ``factor`` while below ``max_bytes``, then ``max_bytes``."""
    if not 1 <= min_bytes <= max_bytes or factor < 2:
        raise ValueError(
            f"need 1 <= min_bytes <= max_bytes and factor >= 2, got min_bytes={min_bytes}, "
            f"max_bytes={max_bytes}, factor={factor}"
        )
    sizes, size = [], min_bytes
    while size < max_bytes:
        sizes.append(size)
        size *= factor
    return [*sizes, max_bytes]


def _positive(flag: str, value: int, minimum: int = 1) -> int:
    if value < minimum:
        raise BenchArgsError(f"{flag} {value} is invalid: it must be at least {minimum}")
    return value


def _build_parser() -> _Parser:
    p = _Parser(prog="phalanx bench comm", description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--world-size", type=int, default=2, help="number of ranks (default 2)")
    add("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    add("--min-bytes", default="4", help="smallest message (default 4)")
    add("--max-bytes", default=None, help="largest message (default 64MiB, 1MiB with --quick)")
    add("--iters", type=int, default=None, help="timed iterations (default 20, 5 with --quick)")
    add("--warmup", type=int, default=None, help="untimed iterations (default 3, 1 with --quick)")
    add("--dtype", default="float32", help=", ".join(DTYPES))
    add("--shm", action="store_true", help="gloo vs shm (copy-in) vs shm-buffers vs memcpy")
    add_common_flags(p, "comm", quick="a few sizes up to 1MiB, few iterations (CI)")
    return p


def _ops(raw: str) -> tuple[str, ...]:
    ops = tuple(o.strip() for o in raw.split(",") if o.strip())
    for o in ops or ("",):
        if o not in OPS:
            raise BenchArgsError(f"--ops {raw!r}: {o!r} is not one of {', '.join(OPS)}")
    return ops


def parse_args(argv: Sequence[str]) -> BenchConfig:
    """Turn ``phalanx bench comm`` flags into a :class:`BenchConfig` (pure; raises on errors).

    Raises:
        BenchArgsError: naming the flag and the value that cannot be used.
    """
    ns = _build_parser().parse_args(list(argv))
    if ns.dtype not in DTYPES:
        raise BenchArgsError(f"--dtype {ns.dtype!r} is not one of {', '.join(DTYPES)}")
    lo = parse_bytes("--min-bytes", ns.min_bytes)
    hi = parse_bytes("--max-bytes", ns.max_bytes or ("1MiB" if ns.quick else "64MiB"))
    if lo > hi:
        raise BenchArgsError(f"--min-bytes {ns.min_bytes} is larger than --max-bytes ({hi} B)")
    iters = ns.iters if ns.iters is not None else (5 if ns.quick else 20)
    warmup = ns.warmup if ns.warmup is not None else (1 if ns.quick else 3)
    return BenchConfig(
        world_size=_positive("--world-size", ns.world_size),
        ops=_ops(ns.ops),
        sizes=tuple(size_list(lo, hi, 16 if ns.quick else 4)),
        iters=_positive("--iters", iters),
        warmup=_positive("--warmup", warmup, 0),
        dtype=ns.dtype,
        json_path=ns.json,
        out=ns.out,
        shm=ns.shm,
    )


def busbw_factor(op: str, world: int) -> float:
    """nccl-tests' bus-bandwidth factor: what each rank's links carry per byte of the result."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("reduce_scatter", "all_gather"):
        return (world - 1) / world
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"op={op!r} has no bus-bandwidth factor")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, like ``numpy.percentile``."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(records: Sequence[dict[str, Any]], world: int) -> list[Row]:
    """Rows from the ranks' records ``{op, bytes, impl, times}`` (seconds), with ratios."""
    rows = [_row(rec, world) for rec in records]
    native = {(r.op, r.bytes): r.busbw_gbps for r in rows if r.impl == "native"}
    memcpy = {(r.op, r.bytes): r.busbw_gbps for r in rows if r.impl == MEMCPY}
    return [
        replace(
            r,
            vs_native=_ratio(r.busbw_gbps, native.get((r.op, r.bytes))),
            vs_memcpy=_ratio(r.busbw_gbps, memcpy.get((r.op, r.bytes))),
        )
        for r in rows
    ]


def _row(rec: dict[str, Any], world: int) -> Row:
    p50, p90 = percentile(rec["times"], 50), percentile(rec["times"], 90)
    algbw = rec["bytes"] / p50 / 1e9 if p50 > 0 else 0.0
    busbw = algbw * (1.0 if rec["impl"] == MEMCPY else busbw_factor(rec["op"], world))
    return Row(rec["op"], rec["bytes"], rec["impl"], p50 * 1e6, p90 * 1e6, algbw, busbw, 1.0)


def _ratio(busbw: float, native: float | None) -> float:
    return busbw / native if native else float("nan")


Impls = dict[str, Callable[[], Any]]


def _calls() -> dict[str, dict[str, Callable[[Any, Any], Any]]]:
    """``calls[op][impl](big, small)``; ``big`` is the whole buffer, ``small`` one rank's share."""
    import torch.distributed as dist

    from phalanx.comm import algorithms as alg

    rs = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    return {
        "all_reduce": {
            "native": lambda big, _: dist.all_reduce(big),
            "ring": lambda big, _: alg.ring_all_reduce(big),
            "tree": lambda big, _: alg.tree_all_reduce(big),
        },
        "reduce_scatter": {
            "native": lambda big, small: rs(small, big),
            "ring": lambda big, small: alg.ring_reduce_scatter(small, big),
        },
        "all_gather": {
            "native": lambda big, small: ag(big, small),
            "ring": lambda big, small: alg.ring_all_gather(big, small),
        },
        "broadcast": {
            "native": lambda big, _: dist.broadcast(big, 0),
            "tree": lambda big, _: alg.tree_broadcast(big, 0),
            "ring": lambda big, _: alg.ring_broadcast(big, 0),
        },
    }


def _impls(
    op: str, nbytes: int, world: int, dtype: Any, shm: ShmBench | None = None
) -> tuple[int, Impls]:
    """The byte count actually used and a zero-argument callable per implementation of ``op``."""
    import torch

    elem = torch.empty((), dtype=dtype).element_size()
    numel = max(1, nbytes // elem)
    if op in SHARDED:  # nccl-tests: bytes = the whole gathered buffer, a multiple of world
        numel = max(1, numel // world) * world
    # zeros: repeated sums neither overflow nor turn subnormal (which would time differently)
    big = torch.zeros(numel, dtype=dtype)
    small = torch.zeros(numel // world if op in SHARDED else 0, dtype=dtype)
    if shm is not None:
        return numel * elem, shm_impls(op, big, small, shm)
    calls = _calls()[op]
    return numel * elem, {name: functools.partial(fn, big, small) for name, fn in calls.items()}


def _measure(impls: Impls, iters: int, warmup: int) -> list[list[float]]:
    """Interleaved timings: ``times[i][k]`` is implementation ``k``'s time in iteration ``i``.

    The order rotates every iteration (ABC, BCA, CAB, ...): on a loaded machine whichever
    implementation always follows the same one can fall into the same unlucky scheduling.
    """
    import torch.distributed as dist

    fns = list(impls.values())
    times = []
    for i in range(warmup + iters):
        row = [0.0] * len(fns)
        for k in _rotated(len(fns), i):
            dist.barrier()
            start = time.perf_counter()
            fns[k]()
            row[k] = time.perf_counter() - start
        if i >= warmup:
            times.append(row)
    return times


def _rotated(n: int, shift: int) -> list[int]:
    return [(k + shift) % n for k in range(n)]


def rank_main(config: BenchConfig, output: Output | None = None) -> list[dict[str, Any]] | None:
    """Measure on every rank (started by :func:`main`); rank 0 returns the records.

    With ``output``, rank 0 records each size's rows as soon as they are measured.
    """
    import torch
    import torch.distributed as dist

    world, dtype = dist.get_world_size(), getattr(torch, config.dtype)
    records = []
    elem = torch.empty((), dtype=dtype).element_size()
    shm = None
    if config.shm:
        shm = ShmBench(max(config.sizes) // elem + 1, dtype)
    for op in config.ops:
        for nbytes in config.sizes:
            actual, impls = _impls(op, nbytes, world, dtype, shm)
            times = torch.tensor(_measure(impls, config.iters, config.warmup), dtype=torch.float64)
            dist.all_reduce(times, dist.ReduceOp.MAX)  # an iteration lasts as its slowest rank
            size = [
                {"op": op, "bytes": actual, "impl": name, "times": times[:, k].tolist()}
                for k, name in enumerate(impls)
            ]
            records += size
            if output is not None:
                output.rows(asdict(row) for row in summarize(size, world))
    return records if dist.get_rank() == 0 else None


def main(argv: Sequence[str] | None = None) -> int:
    """``phalanx bench comm``: measure, print the table and the ``RESULT`` line; exit code."""
    from phalanx.testing import run_distributed

    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
    except BenchArgsError as exc:
        print(f"phalanx bench comm: error: {exc}", file=sys.stderr)
        return 2
    output = Output.create("comm", config.out, config.json_path)
    ranks = run_distributed(
        rank_main,
        config,
        output,
        world_size=config.world_size,
        backend="shm" if config.shm else "gloo",
        timeout=3600,
        collective_timeout=600,
    )
    rows = summarize(ranks[0], config.world_size)
    result = {"benchmark": "comm", "config": asdict(config), "rows": [asdict(r) for r in rows]}
    what = "gloo vs shm" if config.shm else "gloo"
    print(
        f"phalanx bench comm: {what}, world_size={config.world_size}, dtype={config.dtype}, "
        f"p50/p90 over {config.iters} iterations of the slowest rank"
    )
    print(format_table(rows))
    output.result(result)
    return 0


if __name__ == "__main__":
    # re-import so the ranks unpickle rank_main and BenchConfig from phalanx.bench.comm
    from phalanx.bench.comm import main as _main

    sys.exit(_main())
