"""The shared-memory backend's parts in one process: layout, descriptors, ops, sync, worker."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from phalanx.comm.errors import CollectiveMismatchError
from phalanx.comm.plugin import register
from phalanx.comm.shm.backend import ShmProcessGroup
from phalanx.comm.shm.collectives import _chunks, share
from phalanx.comm.shm.descriptor import Call, check_same
from phalanx.comm.shm.futex import futex_wait, futex_wake
from phalanx.comm.shm.layout import CONTROL_BLOCK, PAGE, Layout
from phalanx.comm.shm.ops import check_reduction, reduce_into
from phalanx.comm.shm.settings import slot_bytes_from_env, spin_seconds_from_env
from phalanx.comm.shm.worker import Executor

SUM, MAX, BAND, AVG = (
    op.value for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.BAND, dist.ReduceOp.AVG)
)


def test_registered_for_cpu_without_taking_cpu_from_gloo() -> None:
    register()  # idempotent: import phalanx did it already
    assert "shm" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["shm"] == ["cpu"]
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"


def test_layout_regions_do_not_overlap_and_counters_have_own_cache_lines() -> None:
    lay = Layout(world_size=3, slot_bytes=8 * PAGE)
    regions = [(lay.slot(p, r), lay.slot_bytes) for p in (0, 1) for r in range(3)]
    regions += [(lay.result(p), lay.slot_bytes) for p in (0, 1)]
    regions.sort()
    assert regions[0][0] == lay.control_bytes >= 3 * CONTROL_BLOCK
    for (a, n), (b, _) in itertools.pairwise(regions):
        assert a + n == b and a % PAGE == 0
    assert regions[-1][0] + lay.slot_bytes == lay.total_bytes
    counters = [lay.counter(r) for r in range(3)]
    assert all(b - a >= 64 for a, b in itertools.pairwise(counters))
    assert lay.descriptor(0, 1) + 128 <= lay.counter(1)


def test_slot_and_spin_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_SHM_SLOT_MB", raising=False)
    assert slot_bytes_from_env() == 1 << 20
    monkeypatch.setenv("PHALANX_SHM_SLOT_MB", "0.1")
    assert slot_bytes_from_env() % PAGE == 0 and slot_bytes_from_env() >= 0.1 * 2**20
    for bad in ("lots", "0", "-1"):
        monkeypatch.setenv("PHALANX_SHM_SLOT_MB", bad)
        with pytest.raises(ValueError, match=f"PHALANX_SHM_SLOT_MB='{bad}'"):
            slot_bytes_from_env()
    monkeypatch.setenv("PHALANX_SHM_SPIN_US", "fast")
    with pytest.raises(ValueError, match="PHALANX_SHM_SPIN_US='fast'"):
        spin_seconds_from_env()


def test_chunks_and_shares_cover_every_element_once() -> None:
    assert _chunks(0, 4) == [(0, 0)]
    assert _chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    for n in (0, 1, 2, 7, 100):
        parts = [share(n, 3, r) for r in range(3)]
        assert parts[0][0] == 0 and parts[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
        assert max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1


def test_descriptors_round_trip_and_a_mismatch_names_both_calls() -> None:
    buf = mmap.mmap(-1, 4096)
    call = Call("all_reduce", torch.bfloat16, 1000, SUM, 0, 7)
    buf[256 : 256 + 128] = call.pack()
    assert Call.read(buf, 256) == call
    assert str(call) == "all_reduce(bfloat16, 1000 elements, op=SUM) as call #7"
    other = Call("broadcast", torch.bfloat16, 1000, 0, 1, 7)
    with pytest.raises(CollectiveMismatchError) as err:
        check_same([call, call, other], "shm group 'g': all_reduce (call #7)")
    assert "rank 0 called all_reduce(bfloat16" in str(err.value)
    assert "rank 2 called broadcast(bfloat16, 1000 elements, root=1)" in str(err.value)
    check_same([call, call], "same")
    unnumbered = Call("all_reduce", torch.bfloat16, 1000, SUM, 0, region=3, offset=64)
    for number in (7, 2**40):
        numbered = Call("all_reduce", torch.bfloat16, 1000, SUM, 0, number, 3, 64)
        assert unnumbered.pack_as(number) == numbered.pack()


def test_reductions_refused_as_gloo_refuses_them() -> None:
    with pytest.raises(ValueError, match=r"BAND needs an integer or bool tensor, got .*float32"):
        check_reduction(BAND, torch.float32, "all_reduce")
    with pytest.raises(ValueError, match=r"AVG needs a floating tensor, got torch\.int64"):
        check_reduction(AVG, torch.int64, "all_reduce")
    with pytest.raises(TypeError, match=r"no torch\.complex64"):
        check_reduction(SUM, torch.complex64, "all_reduce")
    with pytest.raises(ValueError, match="PREMUL_SUM"):
        check_reduction(dist.ReduceOp.PREMUL_SUM.value, torch.float32, "all_reduce")
    check_reduction(BAND, torch.bool, "all_reduce")


def test_reduce_into_adds_in_rank_order_rounding_each_step() -> None:
    a, b, c = (torch.tensor([x], dtype=torch.float16) for x in (2048.0, 1.0, 1.0))
    out = torch.empty(1, dtype=torch.float16)
    reduce_into(out, [a, b, c], SUM)
    assert out.item() == (a + b + c).item() == 2048.0  # not 2050 as in float32
    reduce_into(out, [c, b, a], SUM)
    assert out.item() == 2050.0
    reduce_into(out, [a, b], AVG)
    assert out.item() == (a + b).div(2).item()
    reduce_into(out, [b, a, c], MAX)
    assert out.item() == 2048.0


def test_futex_times_out_returns_on_change_and_wakes_a_sleeper() -> None:
    buf = mmap.mmap(-1, 4096)
    word = ctypes.c_uint32.from_buffer(buf, 0)
    addr = ctypes.addressof(word)
    start = time.monotonic()
    futex_wait(addr, 0, 0.05)
    assert 0.04 < time.monotonic() - start < 1.0
    start = time.monotonic()
    futex_wait(addr, 5, 5.0)  # the word is 0, not 5: returns at once
    assert time.monotonic() - start < 1.0

    def bump() -> None:
        time.sleep(0.05)
        word.value = 1
        futex_wake(addr)

    threading.Thread(target=bump).start()
    start = time.monotonic()
    futex_wait(addr, 0, 5.0)
    assert word.value == 1 and time.monotonic() - start < 2.0


def test_executor_runs_in_order_and_a_waiting_callback_does_not_deadlock() -> None:
    ex, log = Executor("test-shm-executor"), []
    works = [ex.submit(lambda i=i: log.append(i), i, wake=True) for i in range(20)]
    nested: list[bool] = []
    works[0].get_future().then(lambda _: nested.append(works[10].wait()))
    for w in reversed(works):
        w.wait()
    assert log == list(range(20)) and nested == [True]

    def boom() -> None:
        raise RuntimeError("collective failed")

    failing = ex.submit(boom, None, wake=False)
    with pytest.raises(RuntimeError, match="collective failed"):
        failing.wait()
    assert failing.is_completed() and isinstance(failing.exception(), RuntimeError)
    with pytest.raises(RuntimeError, match="collective failed"):
        failing.get_future().wait()  # a sync call's future, made when asked, carries the error
    ran = ex.submit(lambda: log.append(20), [torch.ones(2)], wake=False)
    assert log[-1] == 20 and ran.is_success() and ran.exception() is None
    assert ran.get_future() is ran.get_future() and ran.get_future().wait() == ran.result()
    ex.stop()


def test_a_group_of_one_runs_every_collective() -> None:
    pg = ShmProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=5))
    t = torch.arange(5.0)
    opts = dist.AllreduceOptions()
    pg.allreduce([t], opts).wait()
    out = torch.empty(5)
    pg.all_gather_single(out, t, AllgatherOptions()).wait()
    assert torch.equal(out, t) and torch.equal(t, torch.arange(5.0))
    pg.barrier(dist.BarrierOptions()).wait()
    pg.shutdown()


def test_pipelines_use_gloo_style_p2p_on_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.pipeline import runner

    monkeypatch.setattr(runner.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(runner.dist, "get_backend", lambda group=None: "shm")
    assert runner._p2p_mode(None, None, "interleaved", 2) == "eager"  # tags work: gloo's P2P
