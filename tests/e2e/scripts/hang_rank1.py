"""Rank 1 sleeps before the second all-reduce; the hang report appears in the launcher output."""

import time

import torch
import torch.distributed as dist

import phalanx


def wait_for_the_report() -> None:
    time.sleep(5.0)


phalanx.init_process_group("gloo")
t = torch.ones(2)
phalanx.all_reduce(t)
if dist.get_rank() == 1:
    wait_for_the_report()
phalanx.all_reduce(t)
phalanx.destroy_process_group()
