"""backend="shm" on real ranks: a skipped or extra call, a stopped rank, a segment not made.

- One extra same-shape all_reduce on one rank: before, the next two results were wrong (111
  and 31 where 21 and 41 are right) and the error came at the next call that differed. Now the
  call after the extra one raises ``CollectiveMismatchError`` on every rank before it reads any
  data (only the wrongly paired call itself, which no check of its own can tell, is wrong).
- Rank-dependent lines that pair legitimately still pass.
- A SIGSTOPped rank at world size 3 is named by every rank that gives up, not only the first.
- Rank 0 failing to make the segment reaches the other ranks at once, with its reason.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.comm.errors import CollectiveMismatchError
from phalanx.comm.shm.errors import ShmError
from phalanx.testing import run_distributed


def _extra_all_reduce(extra_rank: int) -> list[Any]:
    r, out = dist.get_rank(), list[Any]()
    try:
        if r == extra_rank:
            t = torch.tensor([100.0])
            dist.all_reduce(t)  # the extra call
            out.append(t.item())
        for v in (10, 20):
            t = torch.tensor([float(v + r)])
            dist.all_reduce(t)
            out.append(t.item())
    except CollectiveMismatchError as exc:
        out.append(str(exc))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_extra_same_shape_all_reduce_is_refused_at_the_next_call(world_size: int) -> None:
    extra = world_size - 1
    results = run_distributed(
        _extra_all_reduce, extra, world_size=world_size, backend="shm", timeout=90
    )
    right = {10 * world_size + sum(range(world_size)), 20 * world_size + sum(range(world_size))}
    for rank, out in enumerate(results):
        *values, error = out
        assert isinstance(error, str), out  # every rank raised
        assert "call #1 was paired wrongly" in error and "#2 (all_reduce) is refused" in error
        assert f"Rank {extra} made an extra call" in error
        assert "test_shm_guards.py" in error  # the line of the call, on every rank
        # Only the wrongly paired call #1 returned, and no result of a later call.
        assert len(values) == 1 and not (set(values) & right), (rank, out)


def _rank_dependent_lines() -> list[float]:
    r, out = dist.get_rank(), []
    for i in range(4):
        t = torch.full((3,), float(r + i))
        if r == 0:  # the seeds' pattern: one call, a line per rank
            dist.broadcast(t, 0)
        else:
            dist.broadcast(t, 0)
        out.append(t[0].item())
        s = torch.ones(2)
        if r == 0:
            dist.all_reduce(s)
        _elsewhere(s, r)
        out.append(s[0].item())
    return out


def _elsewhere(s: torch.Tensor, r: int) -> None:
    if r != 0:
        dist.all_reduce(s)  # pairs with rank 0's call above: other lines, no shift


def test_rank_dependent_lines_that_pair_rightly_pass() -> None:
    results = run_distributed(_rank_dependent_lines, world_size=2, backend="shm", timeout=60)
    assert results[0] == results[1] == [0.0, 2.0, 1.0, 2.0, 2.0, 2.0, 3.0, 2.0]


def _stopped_rank(pid_file: str) -> dict[str, Any]:
    r = dist.get_rank()
    if r == 2:
        Path(pid_file).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # until rank 0 is done with its error
    opts = dist.AllreduceOptions()
    opts.timeout = timedelta(seconds=3)  # this call's own: the group's stays long (start-up)
    group = dist.distributed_c10d._get_default_group()
    try:
        group.allreduce([torch.ones(4)], opts).wait()
    except ShmError as exc:
        Path(f"{pid_file}.{r}").write_text("gave up")
        if r == 0:  # rank 2 goes on once both ranks have looked at it (not to be seen arrive)
            while not os.path.exists(f"{pid_file}.1"):
                time.sleep(0.01)
            os.kill(int(Path(pid_file).read_text()), signal.SIGCONT)
        return {"error": str(exc)}
    return {"error": None}


def test_every_rank_that_gives_up_names_a_stopped_rank(tmp_path: Path) -> None:
    pid_file = str(tmp_path / "pid")
    results = run_distributed(
        _stopped_rank,
        pid_file,
        world_size=3,
        backend="shm",
        timeout=90,
        may_die=[2],
    )
    for rank in (0, 1):
        error = results[rank]["error"]
        assert error is not None and "[2]" in error, (rank, error)


def _creator_cannot_reserve() -> dict[str, Any]:
    r = dist.get_rank()
    if r == 0:

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        os.posix_fallocate = full  # this rank's segment cannot get its pages
    start = time.monotonic()
    try:
        dist.new_group(backend="shm")
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "took": time.monotonic() - start}
    return {"error": None}


def test_a_segment_rank_0_cannot_make_fails_every_rank_at_once() -> None:
    results = run_distributed(
        _creator_cannot_reserve, world_size=2, backend="shm", timeout=90, collective_timeout=30
    )
    for rank, result in enumerate(results):
        assert result["error"] is not None and "could not reserve" in result["error"], result
        assert "lower PHALANX_SHM_SLOT_MB" in result["error"]
        assert result["took"] < 15, (rank, result)  # not the 30 s timeout
    assert "rank 0 could not make the group's segment" in results[1]["error"]
