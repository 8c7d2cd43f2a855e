"""The rank job of ``phalanx bench checkpoint``: every implementation, interleaved in rounds.

Each round saves and loads the state with every synchronous implementation (``checkpoint_ops``,
in an order that rotates from round to round), then saves it with each asynchronous one. A
time is the slowest rank's, all ranks started together after a barrier (``common.timed``):

- ``save``: until the checkpoint is on disk (fsync'd) on every rank;
- ``load``: read back into the model's tensors with the files in the page cache (just written);
- ``load_cold``: again after every file was evicted from the page cache (with ``cold``);
- ``block``: how long an asynchronous save held its caller; ``total``: until it was durable;
- ``step_slowdown``: while an asynchronous save writes, the rank keeps taking steps of a
  stand-in training loop (``step_slowdown.py``): how much slower they are than the same steps
  just before the save started, with nothing in flight.

Round 0 warms up (imports, page allocation, staging buffers) and is not recorded; in it every
load, the asynchronous saves' included, goes into zeroed tensors and must give back the saved
state exactly, or the benchmark fails.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from phalanx.bench.checkpoint_ops import (
    ASYNC,
    SYNC,
    AsyncImpl,
    Rank,
    SyncImpl,
    evict,
    make_model,
    stop_dcp_writer,
)
from phalanx.bench.common import Output, timed
from phalanx.bench.step_slowdown import Trainer, slowdown

__all__ = ["Times", "column", "rank_job"]

T = TypeVar("T")
BASELINE_STEPS = 10
"""Steps timed with nothing in flight, just before each asynchronous save."""
Times = dict[str, dict[str, list[float]]]


def _rotated(impls: Sequence[T], shift: int) -> list[T]:
    shift %= len(impls)
    return [*impls[shift:], *impls[:shift]]


def _remove(r: Rank, path: Path) -> None:
    dist.barrier()
    if r.rank == 0:
        shutil.rmtree(path)
    dist.barrier()


def _load(r: Rank, name: str, load: Callable[[Rank, Path], None], path: Path, check: bool) -> float:
    """Seconds ``load`` took; with ``check``, into zeroed tensors, compared with the state."""
    if not check:
        return timed(partial(load, r, path))
    saved = {k: t.clone() for k, t in r.state().items()}
    with torch.no_grad():
        for t in r.state().values():
            t.zero_()
    took = timed(partial(load, r, path))
    wrong = [k for k, t in r.state().items() if not torch.equal(t, saved[k])]
    if wrong:
        raise RuntimeError(f"{name}: rank {r.rank} loaded other values than it saved: {wrong[:5]}")
    return took


def _sync_round(r: Rank, impl: SyncImpl, path: Path, cold: bool, check: bool) -> dict[str, float]:
    out = {"save": timed(partial(impl.save, r, path))}
    out["load"] = _load(r, impl.name, impl.load, path, check)
    if cold:
        if r.rank == 0:
            evict(path)
        out["load_cold"] = timed(partial(impl.load, r, path))
    _remove(r, path)
    return out


def _async_round(
    r: Rank, impl: AsyncImpl, path: Path, check: bool, trainer: Trainer
) -> dict[str, float]:
    handle: list[Any] = []
    baseline = trainer.steps(BASELINE_STEPS)
    block = timed(lambda: handle.append(impl.start(r, path)))
    start = time.perf_counter()
    during = trainer.steps_while(lambda: impl.running(handle[0]))
    stepping = time.perf_counter() - start
    rest = timed(lambda: impl.finish(handle[0]))
    if check:
        _load(r, impl.name, impl.load, path, check)
    _remove(r, path)
    return {
        "block": block,
        "total": block + stepping + rest,
        "step_slowdown": slowdown(baseline, during),
    }


def column(measure: str) -> str:
    """A measure's name in the printed rows: seconds end in ``_s``; a slowdown is a ratio."""
    return measure if measure == "step_slowdown" else f"{measure}_s"


def rank_job(cfg: dict[str, Any]) -> Times:
    """Seconds per implementation and measure (``save``, ``load``, ``block``, ...), by round.

    ``cfg``: ``mb`` (state size), ``rounds``, ``cold``, ``workdir`` (shared by the ranks),
    ``case`` (a label for the printed rows) and ``output`` (an :class:`Output`).
    """
    import phalanx

    world = phalanx.world()
    torch.manual_seed(0)
    r = Rank(make_model(cfg["mb"]), world.rank, world.world_size, dist.new_group(backend="gloo"))
    output: Output = cfg["output"]
    trainer = Trainer()
    times: Times = {}
    for rnd in range(cfg["rounds"] + 1):
        measured: dict[str, dict[str, float]] = {}
        for sync in _rotated(SYNC, rnd):
            path = Path(cfg["workdir"]) / f"{sync.name}-{rnd}"
            measured[sync.name] = _sync_round(r, sync, path, cfg["cold"], check=rnd == 0)
        for impl in _rotated(ASYNC, rnd):
            path = Path(cfg["workdir"]) / f"{impl.name}-{rnd}"
            measured[impl.name] = _async_round(r, impl, path, rnd == 0, trainer)
        if rnd == 0:
            continue
        for name, values in measured.items():
            for measure, seconds in values.items():
                times.setdefault(name, {}).setdefault(measure, []).append(seconds)
        output.rows(
            {"case": cfg["case"], "round": rnd, "impl": name}
            | {column(measure): value for measure, value in values.items()}
            for name, values in measured.items()
        )
    stop_dcp_writer()
    return times
