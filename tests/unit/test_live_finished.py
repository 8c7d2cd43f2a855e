"""A replacement that arrives after the job's members finished is told so at once."""

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
