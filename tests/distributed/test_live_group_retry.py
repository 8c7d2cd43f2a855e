"""A member whose group failed to form can still form the next one with its peers.

Seen in CI (``test_a_second_failure_during_recovery``): one survivor's ``init_process_group``
failed while the other's succeeded; from then on their rendezvous keys differed in torch's
group name (its count of groups built), and no later generation formed.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.recovery.sockets import GroupSockets, abandon_group
from phalanx.testing import run_distributed


def _fail_once_then_form(path: str) -> float:
    rank = phalanx.world().rank
    # This test builds its own groups. A barrier first: gloo's init returns on one rank while
    # the other may still be connecting, and a group destroyed then fails the peer's init.
    dist.barrier()
    phalanx.destroy_process_group()
    store = dist.FileStore(path, 2)
    if rank == 0:  # a generation whose peer never arrives: gloo's rendezvous times out
        with pytest.raises(RuntimeError):
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore("lonely/", store),
                rank=0,
                world_size=2,
                timeout=timedelta(seconds=1),
            )
        abandon_group(GroupSockets())
        store.set("rank0-failed", "1")
    else:  # its last group formed and was destroyed normally
        store.wait(["rank0-failed"])
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("next/", store),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=10),
    )
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return float(t.item())


@pytest.mark.timeout(60)
def test_a_failed_init_does_not_shift_the_next_groups_keys(tmp_path: os.PathLike[str]) -> None:
    results = run_distributed(_fail_once_then_form, os.path.join(tmp_path, "store"), timeout=45)
    assert results == [2.0, 2.0]
