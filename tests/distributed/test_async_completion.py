"""A collective consumed through its future (DDP's communication hooks) or by polling is recorded
as completed: the hang detector's flight record must not keep it "in flight" (issue 15's false
hang reports on every job with fp16_compress_hook)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.data_parallel.hooks import bf16_compress_hook, fp16_compress_hook
from phalanx.diagnostics import tracking
from phalanx.testing import run_distributed


def _in_flight() -> str | None:
    rec = tracking._RECORDER.in_flight()
    return None if rec is None else f"{rec.op} #{rec.seq} at {rec.site}"


def _hooked_ddp_steps() -> dict[str, Any]:
    left: dict[str, Any] = {}
    for hook in (fp16_compress_hook, bf16_compress_hook):
        torch.manual_seed(0)
        model = phalanx.DistributedDataParallel(nn.Linear(16, 4))
        model.register_comm_hook(None, hook)
        for _ in range(3):
            model(torch.randn(8, 16)).sum().backward()
        left[hook.__name__] = _in_flight()
    return left


def _future_and_polling() -> dict[str, Any]:
    t = torch.full((4,), float(dist.get_rank() + 1))
    fut = phalanx.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True).get_future()
    fut.wait()
    after_future = _in_flight()
    averaged = t.tolist()
    work = phalanx.all_reduce(torch.ones(4), async_op=True)
    while not work.is_completed():
        pass
    return {"future": after_future, "avg": averaged, "polled": _in_flight()}


def _dropped_handle() -> str | None:
    phalanx.all_reduce(torch.ones(4), async_op=True)  # nobody waits, polls or asks its future
    phalanx.barrier()  # after the all-reduce in the group's order: it has completed
    deadline = time.monotonic() + 2.0
    while _in_flight() is not None and time.monotonic() < deadline:
        time.sleep(0.01)  # the work's future runs its callback on gloo's thread
    return _in_flight()


def test_a_handle_nobody_consumes_is_recorded_as_complete() -> None:
    assert run_distributed(_dropped_handle, timeout=60) == [None, None]


def test_ddp_with_compression_hooks_leaves_nothing_in_flight() -> None:
    for left in run_distributed(_hooked_ddp_steps, timeout=120):
        assert left == {"fp16_compress_hook": None, "phalanx_bf16_compress_hook": None}


def test_a_future_or_polling_records_completion_and_avg_divides() -> None:
    for got in run_distributed(_future_and_polling, timeout=120):
        assert got == {"future": None, "avg": [1.5] * 4, "polled": None}
