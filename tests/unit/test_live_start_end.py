"""A replacement at the ends of a live job: before the first generation formed, after the
members finished, or after they all died."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from phalanx.recovery import JobFinished, LiveGroup, Member, RecoveryError
from phalanx.recovery.agree import members_key
from phalanx.recovery.keys import live_signer, report_death, report_finished


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


def test_a_replacement_learns_the_end_from_the_launcher_when_no_member_closed() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    # The launcher saw slot 0.0's worker exit 0 (its script never called Job.close()).
    report_finished(live_signer(store, None, ""), "0.0")
    with pytest.raises(JobFinished, match=r"member 0\.1#1 arrived after the job's members"):
        LiveGroup(store, "0.1", 1, join_timeout=10)


def test_a_replacement_does_not_wait_for_a_job_whose_members_all_died() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    live = live_signer(store, None, "")
    live.put(members_key(0), [Member("0.0", 0).to_json(), Member("0.1", 0).to_json()])
    live.put("current", 0)
    for slot in ("0.0", "0.1"):  # the launcher's death records
        report_death(live, slot, 0)
    with pytest.raises(RecoveryError, match=r"0\.1#1 cannot join: every member of generation 0"):
        LiveGroup(store, "0.1", 1, join_timeout=10)  # not join_timeout: at once
