"""backend="shm" on real ranks: ordering, DDP, fallback to gloo, errors, faults, /dev/shm.

Parity of every collective with gloo is in ``test_shm_parity.py``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.comm.errors import CollectiveMismatchError
from phalanx.comm.shm.errors import PeerDiedError, ShmError
from phalanx.testing import run_distributed


def _segment_path(group: Any = None) -> str:
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    return str(pg.segment_path)


def _ordering_and_async() -> dict[str, Any]:
    r, out = dist.get_rank(), {}
    out["unlinked_after_init"] = not os.path.exists(_segment_path())
    tensors = [torch.full((1000 + i,), float(i * (r + 1))) for i in range(12)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    b = torch.full((3,), float(r))
    dist.broadcast(b, 1)  # synchronous, queued behind the async ones: runs after them
    works.append(dist.all_reduce(b, op=dist.ReduceOp.MAX, async_op=True))
    for w in reversed(works):
        w.wait()
    out["async"] = [t[0].item() for t in tensors] + b.tolist()
    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    out["future"] = fut.wait()[0].tolist()
    return out


def _mismatches() -> dict[str, str]:
    r, errors = dist.get_rank(), {}
    cases = {
        "size": lambda: dist.all_reduce(torch.ones(10 + 10 * r)),
        "op": lambda: dist.all_reduce(torch.ones(4), op=[dist.ReduceOp.SUM, dist.ReduceOp.MAX][r]),
        "kind": lambda: dist.all_reduce(torch.ones(4)) if r else dist.broadcast(torch.ones(4), 0),
        "async": lambda: dist.all_reduce(torch.ones(3 + r), async_op=True).wait(),
    }
    for name, call in cases.items():
        try:
            call()
        except CollectiveMismatchError as exc:
            errors[name] = str(exc)
    t = torch.ones(5)
    dist.all_reduce(t)  # the group is still usable
    errors["after"] = str(t.tolist())
    return errors


def _fallback_and_checks() -> dict[str, Any]:
    r, out = dist.get_rank(), {}
    t = torch.zeros(3)
    if r == 0:
        dist.send(torch.full((3,), 7.0), 1)
    else:
        dist.recv(t, 0)
    out["p2p"] = t.tolist()
    gathered = [torch.zeros(1), torch.zeros(1)] if r == 0 else None
    dist.gather(torch.full((1,), float(r)), gathered, dst=0)
    out["gather"] = None if gathered is None else [g.item() for g in gathered]
    s = torch.zeros(2)
    dist.scatter(s, [torch.full((2,), 5.0 + i) for i in range(2)] if r == 0 else None, src=0)
    out["scatter"] = s.tolist()
    sparse = torch.sparse_coo_tensor([[r]], [1.0], (2,))  # sparse gradients: gloo's all-reduce
    dist.all_reduce(sparse)
    out["sparse"] = sparse.to_dense().tolist()
    objs: list[Any] = [None, None]
    dist.all_gather_object(objs, {"rank": r})
    out["objects"] = objs
    sub = dist.new_group([0, 1])
    u = torch.ones(2)
    dist.all_reduce(u, group=sub)
    out["subgroup"] = (dist.get_backend(sub), u.tolist(), not os.path.exists(_segment_path(sub)))
    dist.destroy_process_group(sub)
    refused = []
    for call in (
        lambda: dist.all_reduce(torch.ones(4, 2).t()),  # not contiguous
        lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND),  # float BAND
        lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG),
        lambda: dist.all_to_all_single(torch.empty(3), torch.ones(3)),  # 3 rows, 2 ranks
    ):
        try:
            call()
        except (ValueError, TypeError) as exc:
            refused.append(str(exc))
    out["refused"] = refused
    return out


def test_async_calls_run_in_issue_order_and_complete_their_futures() -> None:
    results = run_distributed(_ordering_and_async, world_size=2, backend="shm", timeout=60)
    for res in results:
        assert res["unlinked_after_init"]
        assert res["async"] == [3.0 * i for i in range(12)] + [1.0, 1.0, 1.0]
        assert res["future"] == [2.0] * 4


def test_mismatched_calls_raise_on_every_rank_naming_both() -> None:
    results = run_distributed(_mismatches, world_size=2, backend="shm", timeout=60)
    for errors in results:
        assert "all_reduce(float32, 10 elements, op=SUM)" in errors["size"]
        assert "rank 1 called all_reduce(float32, 20 elements, op=SUM)" in errors["size"]
        assert "op=MAX" in errors["op"] and "op=SUM" in errors["op"]
        assert "broadcast" in errors["kind"] and "all_reduce" in errors["kind"]
        assert "3 elements" in errors["async"] and "4 elements" in errors["async"]
        assert errors["after"] == str([2.0] * 5)


def test_other_calls_fall_back_to_gloo_and_bad_input_is_refused() -> None:
    results = run_distributed(_fallback_and_checks, world_size=2, backend="shm", timeout=60)
    assert results[1]["p2p"] == [7.0] * 3
    assert results[0]["gather"] == [0.0, 1.0]
    assert [r["scatter"] for r in results] == [[5.0, 5.0], [6.0, 6.0]]
    for res in results:
        assert res["objects"] == [{"rank": 0}, {"rank": 1}]
        assert res["sparse"] == [1.0, 1.0]
        assert res["subgroup"] == ("shm", [2.0, 2.0], True)
        assert len(res["refused"]) == 4, res["refused"]
        assert "contiguous" in res["refused"][0]
        assert "BAND" in res["refused"][1] and "float32" in res["refused"][1]
        assert "AVG" in res["refused"][2] and "int32" in res["refused"][2]


def _train(backend_of_group: str, phalanx_ddp: bool) -> list[torch.Tensor]:
    group = None if backend_of_group == "shm" else dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    wrap = phalanx.DistributedDataParallel if phalanx_ddp else nn.parallel.DistributedDataParallel
    ddp = wrap(model, process_group=group, bucket_cap_mb=0.0002)  # two buckets (one a layer)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(4):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_on_both() -> tuple[list[bool], list[int]]:
    """Same parameters on shm as on gloo (torch's DDP, phalanx's); the zero-copy calls each made."""
    pg = dist.distributed_c10d._get_default_group()
    same, zero_copy = [], []
    for phalanx_ddp in (False, True):
        before = pg.zero_copy_calls  # type: ignore[attr-defined]
        ours = _train("shm", phalanx_ddp)
        zero_copy.append(pg.zero_copy_calls - before)  # type: ignore[attr-defined]
        theirs = _train("gloo", phalanx_ddp)
        same.append(all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)))
    return same, zero_copy


def test_torch_and_phalanx_ddp_train_as_on_gloo() -> None:
    # Two ranks: the gradient sums are a + b on both backends, so bit for bit. phalanx's DDP
    # keeps its buckets in shared memory: every bucket all-reduce (several buckets, four
    # steps) takes the zero-copy path; torch's DDP has buckets of its own (copy-in).
    for same, (torch_zero_copy, phalanx_zero_copy) in run_distributed(
        _ddp_on_both, world_size=2, backend="shm", timeout=60
    ):
        assert same == [True, True]
        assert torch_zero_copy == 0 and phalanx_zero_copy >= 2 * 4


def _killed_peer() -> dict[str, Any]:
    path = _segment_path()
    if dist.get_rank() == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000))
    except PeerDiedError as exc:
        return {"error": str(exc), "took": time.monotonic() - start, "path": path}
    return {"error": None, "path": path}


def test_killed_peer_is_named_at_once_and_leaves_nothing_in_dev_shm() -> None:
    result = run_distributed(
        _killed_peer, world_size=2, backend="shm", timeout=60, collective_timeout=20, may_die=[1]
    )[0]
    assert "rank 1" in result["error"] and "died" in result["error"]
    assert "all_reduce" in result["error"]
    assert result["took"] < 5  # far below the 20 s timeout
    assert result["path"].startswith("/dev/shm/phalanx-shm-")
    assert not os.path.exists(result["path"])


def _stuck_peer() -> dict[str, Any]:
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(2.5)
    cpu, start = time.process_time(), time.monotonic()
    try:
        dist.all_reduce(torch.ones(10))
    except ShmError as exc:
        took, used = time.monotonic() - start, time.process_time() - cpu
        return {"error": str(exc), "took": took, "cpu": used, "type": type(exc).__name__}
    return {"error": None}


def test_stuck_peer_times_out_named_without_burning_cpu() -> None:
    results = run_distributed(
        _stuck_peer, world_size=2, backend="shm", timeout=60, collective_timeout=1.0
    )
    first = results[0]
    assert "rank(s) [1]" in first["error"] and "all_reduce" in first["error"]
    assert "timeout" in first["error"]
    assert 0.9 < first["took"] < 2.5
    assert first["cpu"] < 0.25 * first["took"]  # it slept in the kernel, did not spin
    assert first["type"] == "ShmTimeoutError"
    # rank 0 gave up on the call: rank 1, late, must not complete it with stale data
    assert "rank 0 gave up" in results[1]["error"] and "all_reduce" in results[1]["error"]
    assert results[1]["took"] < 0.5


def _fsdp2_sums(steps: int = 3) -> list[float]:
    """FSDP2 training; after each step, every parameter made whole (DTensor's functional
    collectives); the last step's sums. ``tools/shm_dtensor_stall.py`` runs it long."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    sums: list[float] = []
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=g)).sum().backward()
        opt.step()
        sums = [p.full_tensor().sum().item() for p in model.parameters()]
    return sums


def test_torch_fsdp2_trains_as_on_gloo() -> None:
    ours = run_distributed(_fsdp2_sums, world_size=2, backend="shm", timeout=60)
    assert ours == run_distributed(_fsdp2_sums, world_size=2, backend="gloo", timeout=60)


def _uneven_join() -> int:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    steps = 0
    with ddp.join(divide_by_initial_world_size=False):
        for _ in range(2 + 3 * rank):
            opt.zero_grad()
            ddp(torch.randn(3, 4)).sum().backward()
            opt.step()
            steps += 1
    return steps


def test_torch_ddp_join_with_uneven_inputs() -> None:
    # torch's join hands the work of a forward all-reduce to the reducer, which uses it in
    # backward after Python dropped it: the backend must keep it alive (it hung before).
    assert run_distributed(_uneven_join, world_size=2, backend="shm", timeout=30) == [2, 5]


def _stuck_peer_through_phalanx() -> str:
    if dist.get_rank() == 1:
        time.sleep(2.5)
        return ""
    try:
        phalanx.all_reduce(torch.ones(4))
    except phalanx.CollectiveError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_phalanx_blames_a_stuck_peer_on_shm_as_on_gloo() -> None:
    # shm's errors are torch's DistBackendError, so phalanx adds what the others were doing
    message = run_distributed(
        _stuck_peer_through_phalanx, world_size=2, backend="shm", collective_timeout=1.0
    )[0]
    assert message.startswith("CollectiveTimeoutError"), message
    assert "rank(s) [1] never reached it" in message and "collective #1" in message


def _zero(backend_of_group: str, stage: int) -> list[torch.Tensor]:
    from phalanx.sharding import ZeroRedundancyOptimizer

    group = None if backend_of_group == "shm" else dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        stage=stage,
        process_group=group,
        bucket_cap_mb=0.0005,
        lr=0.01,
    )
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _zero_on_both() -> list[tuple[bool, int]]:
    """ZeRO-1 and ZeRO-2 on shm and on gloo: same parameters; the zero-copy calls on shm."""
    pg = dist.distributed_c10d._get_default_group()
    out = []
    for stage in (1, 2):
        before = pg.zero_copy_calls  # type: ignore[attr-defined]
        ours = _zero("shm", stage)
        calls = pg.zero_copy_calls - before  # type: ignore[attr-defined]
        theirs = _zero("gloo", stage)
        out.append((all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), calls))
    return out


def test_zero_1_and_2_stage_in_shared_memory_and_train_as_on_gloo() -> None:
    # ZeRO-1/2's staging buffers live in shared memory on an shm group: every bucket's
    # reduce-scatter and the parameters' all-gather after each step take the zero-copy path.
    for (same1, calls1), (same2, calls2) in run_distributed(
        _zero_on_both, world_size=2, backend="shm", timeout=60
    ):
        assert same1 and same2
        assert calls1 >= 2 * 3 and calls2 >= 2 * 3, (calls1, calls2)
