"""A replacement at the ends of a live job: before the first generation formed, or after the
members finished."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from phalanx.recovery import JobFinished, LiveGroup


def test_a_replacement_after_the_end_raises_job_finished() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    alone = LiveGroup(store, "0.0", 0, rank=0, world_size=1, join_timeout=10)
    assert alone.world_size == 1 and dist.is_initialized()
    alone.close()
    assert not dist.is_initialized()
    with pytest.raises(JobFinished, match=r"member 0\.1#1 arrived after the job's members"):
        LiveGroup(store, "0.1", 1, join_timeout=10)
    assert not dist.is_initialized()


def test_a_replacement_before_the_first_generation_takes_its_slot() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    # slot 0.0's first process died before it said it started: its replacement starts the job
    replacement = LiveGroup(store, "0.0", 1, rank=0, world_size=1, join_timeout=10)
    assert not replacement.joined and replacement.generation == 0
    assert replacement.newcomers == [0]  # it holds no state yet: the job's start gives it one
    replacement.close()
