"""phalanx.horovod on 2 and 3 gloo ranks: every op against values computed locally, the broadcast
helpers, and DistributedOptimizer parity with one process on the full batch.

Tolerance: replicas must be bit-identical to each other (the same reduced bytes, the same
optimizer); against the single-process reference they differ by floating-point reassociation of
the mean only, so rtol=1e-5, atol=1e-6 (fp16 compression: atol=2e-3, half precision on the wire).
Checks on the ranks run inside one ``run_distributed`` call per world size; a failed assertion
comes back with the rank's traceback.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
import phalanx.horovod as hvd
from phalanx.data_parallel.reducer import Reducer
from phalanx.testing import run_distributed

STEPS = 3
PER_RANK = 4  # samples per rank per backward pass


def _eq(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert torch.equal(got, want), f"{what}: got {got.tolist()}, want {want.tolist()}"


def _close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=what)


def _raises(fn: Any, *words: str) -> None:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        for w in words:
            assert w in str(exc), f"{w!r} not in error: {exc}"
        return
    raise AssertionError(f"no error raised; expected one mentioning {words}")


# ---- collectives ------------------------------------------------------------------------------
def _check_allreduce(r: int, n: int) -> None:
    xs = [torch.arange(6.0).reshape(2, 3) * (k + 1) - k for k in range(n)]
    x = xs[r].clone()
    total = sum(xs[1:], xs[0].clone())
    _eq(hvd.allreduce(x, op=hvd.Sum), total, "Sum")
    _close(hvd.allreduce(x), total / n, "Average")
    _eq(hvd.allreduce(x, op=hvd.Min), torch.stack(xs).amin(0), "Min")
    _eq(hvd.allreduce(x, op=hvd.Max), torch.stack(xs).amax(0), "Max")
    _close(hvd.allreduce(x, op=hvd.Product), torch.stack(xs).prod(0), "Product")
    _close(
        hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25),
        total * 0.5,
        "pre/postscale",
    )
    _close(hvd.allreduce(x, prescale_factor=3.0, postscale_factor=0.5), total * 1.5 / n, "avg")
    _eq(x, xs[r], "allreduce left its input unchanged")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        _eq(hvd.allreduce(x, average=False), total, "average=False")
    ints = torch.tensor([3 * r + 1, -(3 * r + 1)])
    isum = sum(3 * k + 1 for k in range(n))
    _eq(hvd.allreduce(ints), torch.tensor([math.trunc(isum / n), -math.trunc(isum / n)]), "int")
    half = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert half.dtype == torch.float32
    _close(half, total / n, "fp16 compression", atol=2e-2)
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y
    _eq(y, total, "allreduce_")
    t = x.clone().t()  # not contiguous: reduced through a copy, written back
    hvd.allreduce_(t, op=hvd.Sum)
    _eq(t, total.t(), "allreduce_ on a transposed view")


def _check_async_and_grouped(r: int, n: int) -> None:
    x = torch.full((5,), float(r + 1))
    total = float(n * (n + 1) // 2)
    handle = hvd.allreduce_async(x, op=hvd.Sum)
    out = hvd.synchronize(handle)
    assert hvd.poll(handle)
    assert hvd.synchronize(handle) is out
    _eq(out, torch.full((5,), total), "allreduce_async")
    y = x.clone()
    assert hvd.synchronize(hvd.allreduce_async_(y, op=hvd.Max)) is y
    _eq(y, torch.full((5,), float(n)), "allreduce_async_")
    group = [x.clone(), torch.tensor([r, 2 * r]), x.double().reshape(5, 1)]
    got = hvd.grouped_allreduce(group, op=hvd.Sum)
    isum = n * (n - 1) // 2
    _eq(got[0], torch.full((5,), total), "grouped float")
    _eq(got[1], torch.tensor([isum, 2 * isum]), "grouped int")
    _eq(got[2], torch.full((5, 1), total, dtype=torch.float64), "grouped double")
    got = hvd.synchronize(hvd.grouped_allreduce_async(group))
    _close(got[0], torch.full((5,), total / n), "grouped async average")
    assert hvd.grouped_allreduce_(group, op=hvd.Sum)[1] is group[1]
    _eq(group[1], torch.tensor([isum, 2 * isum]), "grouped_allreduce_")


def _check_gather_broadcast(r: int, n: int) -> None:
    pieces = [torch.full((k + 1, 2), float(k)) for k in range(n)]
    _eq(hvd.allgather(pieces[r]), torch.cat(pieces), "allgather, first dims 1..n")
    _eq(hvd.synchronize(hvd.allgather_async(pieces[r])), torch.cat(pieces), "allgather_async")
    _eq(hvd.allgather(torch.tensor(r)), torch.arange(n), "allgather of scalars")
    root = n - 1
    y = torch.full((3,), float(r))
    _eq(hvd.broadcast(y, root), torch.full((3,), float(root)), "broadcast")
    _eq(y, torch.full((3,), float(r)), "broadcast left its input unchanged")
    assert hvd.broadcast_(y, root) is y
    _eq(y, torch.full((3,), float(root)), "broadcast_")
    z = torch.full((2, 2), float(r))
    hvd.synchronize(hvd.broadcast_async_(z, 0))
    _eq(z, torch.zeros(2, 2), "broadcast_async_")
    _eq(hvd.synchronize(hvd.broadcast_async(y * 0 + r, 0)), torch.zeros(3), "broadcast_async")
    _raises(
        lambda: hvd.allgather(torch.zeros(1, 2 + r)),
        "rank 0 sent float32 [*, 2]",
        "rank 1 sent float32 [*, 3]",
    )
    _raises(lambda: hvd.broadcast(y, n), f"root_rank={n}")


def _check_alltoall(r: int, n: int) -> None:
    x = torch.arange(2 * n, dtype=torch.float32) + 100 * r  # rows 2j, 2j+1 go to rank j
    want = torch.cat(
        [torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * s for s in range(n)]
    )
    _eq(hvd.alltoall(x), want, "alltoall, even splits")
    splits = [j + 1 for j in range(n)]  # j+1 rows for rank j, valued 100*r + j
    rows = torch.cat([torch.full((j + 1, 2), 100.0 * r + j) for j in range(n)])
    out, received = hvd.alltoall(rows, splits=splits)
    _eq(out, torch.cat([torch.full((r + 1, 2), 100.0 * s + r) for s in range(n)]), "alltoall")
    _eq(received, torch.full((n,), r + 1, dtype=torch.int32), "received splits")
    out2, _ = hvd.synchronize(hvd.alltoall_async(rows, splits=torch.tensor(splits)))
    _eq(out2, out, "alltoall_async")
    _raises(lambda: hvd.alltoall(torch.zeros(n, 1 + r)), "alltoall", "[*, 1]", "[*, 2]")


def _check_autograd(r: int, n: int) -> None:
    x = torch.ones(2, 3, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    _eq(x.grad, torch.full((2, 3), float(n)), "allreduce gradient")
    piece = torch.ones(r + 1, 2, requires_grad=True)
    weights = torch.arange(n * (n + 1) // 2 * 2, dtype=torch.float32).reshape(-1, 2)
    (hvd.allgather(piece) * weights).sum().backward()
    offset = r * (r + 1) // 2
    _eq(piece.grad, weights[offset : offset + r + 1], "allgather gradient (Horovod's average)")


def _check_objects_and_process(r: int, n: int) -> None:
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (r, n, r, n)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_initialized() and hvd.gloo_enabled() and not hvd.mpi_enabled()
    obj = {"epoch": 3, "names": ["a", r], "t": torch.tensor([1.5, r])}
    got = hvd.broadcast_object(obj if r == 1 else None, root_rank=1)
    assert got["epoch"] == 3 and got["names"] == ["a", 1]
    _eq(got["t"], torch.tensor([1.5, 1.0]), "broadcast_object tensor")
    assert hvd.allgather_object({"rank": r}) == [{"rank": k} for k in range(n)]
    _raises(
        lambda: hvd.allreduce(torch.ones(1), op=hvd.Adasum),
        "Adasum is not supported, use Average or Sum",
    )
    for call in (hvd.reducescatter, hvd.allreduce):  # Horovod's own tests expect RuntimeError
        try:
            call(torch.ones(n * 4), op=hvd.Adasum)
        except RuntimeError as exc:
            assert isinstance(exc, ValueError) and "op=Adasum" in str(exc), exc
        else:
            raise AssertionError(f"{call.__name__}(op=Adasum) did not raise")
    _raises(lambda: hvd.allreduce(torch.ones(1), op=7), "op=7")
    _raises(lambda: hvd.synchronize(3), "handle")
    hvd.barrier()
    if r == n - 1:
        time.sleep(0.3)  # arrive last, on purpose
    assert hvd.join() == n - 1
    assert hvd.join() in range(n)  # a second join works too (fresh keys)


def _check_process_set(r: int, n: int) -> None:
    members = [0, n - 1]
    ps = torch.distributed.new_group(members)  # every rank creates it; only members use it
    if r not in members:
        return
    x = torch.full((2,), float(r + 1))
    _eq(hvd.allreduce(x, op=hvd.Sum, process_set=ps), torch.full((2,), float(n + 1)), "set sum")
    _eq(hvd.broadcast(x, n - 1, process_set=ps), torch.full((2,), float(n)), "set broadcast")
    _eq(hvd.allgather(x[:1], process_set=ps), torch.tensor([1.0, float(n)]), "set allgather")
    if n > 2:
        _raises(lambda: hvd.broadcast(x, 1, process_set=ps), "root_rank=1", "[0, 2]")


def _check_hvd_process_set(r: int, n: int) -> None:
    if n < 3:
        return  # at two ranks, a set of two is the global set
    pair = hvd.add_process_set([n - 1, 0])  # every rank adds it
    assert (pair.ranks, pair.size(), pair.included()) == ([0, n - 1], 2, r in (0, n - 1))
    if pair.included():
        x = torch.full((2,), float(r + 1))
        _eq(hvd.allreduce(x, op=hvd.Sum, process_set=pair), torch.full((2,), float(n + 1)), "sum")
        _eq(hvd.broadcast(x, n - 1, process_set=pair), torch.full((2,), float(n)), "broadcast")
        _eq(
            hvd.reducescatter(torch.ones(4), op=hvd.Sum, process_set=pair),
            torch.full((2,), 2.0),
            "reducescatter on a set",
        )
        _raises(lambda: hvd.broadcast(x, 1, process_set=pair), "root_rank=1", "[0, 2]")
    hvd.barrier()
    assert hvd.remove_process_set(pair)


def _all_ops() -> bool:
    r, n = hvd.rank(), hvd.size()
    hvd.init()  # already initialised by the harness: a no-op
    for check in (
        _check_allreduce,
        _check_async_and_grouped,
        _check_gather_broadcast,
        _check_alltoall,
        _check_autograd,
        _check_objects_and_process,
        _check_process_set,
        _check_hvd_process_set,
    ):
        check(r, n)
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_ops_match_local_expectations(world_size: int) -> None:
    assert run_distributed(_all_ops, world_size=world_size, timeout=90) == [True] * world_size


# ---- broadcast_parameters / broadcast_optimizer_state ---------------------------------------
def _bn_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    loss = model(torch.randn(6, 4, generator=g)).square().mean()
    loss.backward()
    opt.step()


def _broadcast_state() -> dict[str, Any]:
    r = hvd.rank()
    model = _bn_model(seed=10 + r)  # different on purpose
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1), betas=(0.9, 0.999 - 0.1 * r))
    if r == 0:
        _step(model, opt, seed=1)  # only rank 0 has optimizer state
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()
    after = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt, seed=2)  # the same data everywhere: must stay identical
    other = _bn_model(seed=20 + r)
    hvd.broadcast_parameters(other.named_parameters(), root_rank=hvd.size() - 1)
    return {
        "model": after,
        "opt_state": {k: dict(v) for k, v in state["state"].items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
        "stepped": [p.detach().clone() for p in model.parameters()],
        "other": [p.detach().clone() for p in other.parameters()],
    }


def test_broadcast_parameters_and_optimizer_state_make_ranks_identical() -> None:
    results = run_distributed(_broadcast_state, world_size=2, timeout=60)
    a, b = results
    assert a["model"].keys() == b["model"].keys() and "1.num_batches_tracked" in a["model"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"state_dict entry {k} differs"
    assert a["groups"] == b["groups"] and a["groups"][0]["lr"] == 0.01
    assert a["opt_state"].keys() == b["opt_state"].keys() and len(a["opt_state"]) == 6
    for pid, st in a["opt_state"].items():
        for key, value in st.items():
            assert torch.equal(value, b["opt_state"][pid][key]), f"state {pid}.{key} differs"
    for x, y in zip(a["stepped"], b["stepped"]):
        assert torch.equal(x, y), "ranks diverged on the step after the broadcast"
    for x, y in zip(a["other"], b["other"]):
        assert torch.equal(x, y), "broadcast_parameters(named_parameters(), root_rank=1)"


# ---- DistributedOptimizer parity -------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.spare = nn.Linear(16, 4)  # in the optimizer, never used: Horovod tolerates it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


# micro: backward passes per step; div: each pass's loss is divided by it; scale: the
# reference multiplies the full-batch loss by it (Sum: N times the average).
OPT_CASES: dict[str, dict[str, Any]] = {
    "sgd_momentum": {"opt": "sgd"},
    "adam": {"opt": "adam"},
    "accumulate_2": {"opt": "sgd", "bpps": 2, "micro": 2, "div": 2},
    "adam_accumulate_2": {"opt": "adam", "bpps": 2, "micro": 2, "div": 2},
    "step_before_k_passes": {"opt": "sgd", "bpps": 3, "micro": 2, "div": 3},
    "sum": {"opt": "plain_sgd", "op": "sum"},
    "predivide": {"opt": "sgd", "predivide": 2.0},
    "fp16": {"opt": "sgd", "fp16": True},
    "one_bucket_per_layer": {"opt": "adam", "groups": 5},
    "no_names": {"opt": "sgd", "unnamed": True},
    "synchronize_then_clip": {"opt": "sgd", "clip": 0.05},
}


def _make_opt(case: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    if case["opt"] == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.0 if case["opt"] == "plain_sgd" else 0.9)


def _data(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(PER_RANK, 8, generator=g), torch.randint(0, 4, (PER_RANK,), generator=g)


def _wrap(case: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    return hvd.DistributedOptimizer(
        opt,
        named_parameters=None if case.get("unnamed") else model.named_parameters(),
        compression=hvd.Compression.fp16 if case.get("fp16") else hvd.Compression.none,
        backward_passes_per_step=case.get("bpps", 1),
        op=hvd.Sum if case.get("op") == "sum" else hvd.Average,
        gradient_predivide_factor=case.get("predivide", 1.0),
        groups=case.get("groups"),
    )


def _train(name: str) -> list[torch.Tensor]:
    case, r = OPT_CASES[name], hvd.rank()
    torch.manual_seed(r)
    model = _Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _wrap(case, model, _make_opt(case, model.parameters()))
    assert isinstance(opt, type(_make_opt(case, [torch.zeros(1, requires_grad=True)])))
    assert isinstance(opt._hvd_sync.reducer, Reducer)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(case.get("micro", 1)):
            phalanx.reset_comm_stats()
            x, y = _data(step, micro, r)
            (nn.functional.cross_entropy(model(x), y) / case.get("div", 1)).backward()
            # Accumulated locally (no communication), or all-reduced during this backward.
            synced = "all_reduce" in phalanx.comm_stats()
            assert synced == (micro + 1 >= case.get("bpps", 1)), (name, step, micro, synced)
        if "clip" in case:
            opt.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    opt._hvd_sync.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


def _train_all() -> dict[str, list[torch.Tensor]]:
    return {name: _train(name) for name in OPT_CASES}


def _reference(case: dict[str, Any], world: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _Net()
    opt = _make_opt(case, model.parameters())
    micro = case.get("micro", 1)
    scale = (world if case.get("op") == "sum" else 1) * micro / case.get("div", 1)
    for step in range(STEPS):
        opt.zero_grad()
        batches = [_data(step, m, r) for r in range(world) for m in range(micro)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        (nn.functional.cross_entropy(model(x), y) * scale).backward()
        if "clip" in case:
            nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_optimizer_matches_single_process(world_size: int) -> None:
    results = run_distributed(_train_all, world_size=world_size, timeout=120)
    for name, case in OPT_CASES.items():
        for rank in range(1, world_size):
            for a, b in zip(results[0][name], results[rank][name]):
                assert torch.equal(a, b), f"{name}: rank {rank} differs from rank 0"
        atol = 2e-3 if case.get("fp16") else 1e-6
        for i, (got, want) in enumerate(zip(results[0][name], _reference(case, world_size))):
            _close(got, want, f"{name}: parameter {i} differs from one process", atol=atol)
        spare = results[0][name][4:]
        torch.manual_seed(0)
        for got, init in zip(spare, list(_Net().parameters())[4:]):
            assert torch.equal(got, init), f"{name}: the unused layer moved"


# ---- mistakes are named ------------------------------------------------------------------------
def _mistakes() -> bool:
    r = hvd.rank()
    model = _Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    dist_opt = hvd.DistributedOptimizer
    _raises(
        lambda: dist_opt(sgd, [*named, ("fc1.weight", named[0][1])]), "duplicates ['fc1.weight']"
    )
    _raises(lambda: dist_opt(sgd, named[1:]), "param_groups[0]['params'][0] (shape [16, 8])")
    _raises(lambda: dist_opt(sgd, op=hvd.Adasum), "Adasum is not supported, use Average or Sum")
    _raises(lambda: dist_opt(sgd, op=hvd.Max), "op=Max")
    _raises(lambda: dist_opt(sgd, op=hvd.Sum, gradient_predivide_factor=2.0), "op=hvd.Average")
    _raises(lambda: dist_opt(sgd, backward_passes_per_step=0), "backward_passes_per_step")
    _raises(lambda: dist_opt(sgd, compression="fp16"), "compression=")
    _raises(lambda: hvd.broadcast_parameters(3, 0), "params must be")
    wrapped = dist_opt(sgd, model.named_parameters(), backward_passes_per_step=2)
    _raises(lambda: dist_opt(wrapped), "already a DistributedOptimizer")
    x, y = _data(0, 0, r)
    nn.functional.cross_entropy(model(x), y).backward()
    _raises(wrapped.zero_grad, "after 1 of backward_passes_per_step=2")
    wrapped.step()  # catches up: all-reduces the one pass
    wrapped.zero_grad()
    wrapped._hvd_sync.remove_hooks()
    odd = nn.Linear(3, 2 + r)  # a different model on each rank
    _raises(
        lambda: dist_opt(torch.optim.SGD(odd.parameters(), lr=0.1), odd.named_parameters()),
        "the parameters on rank 1 differ",
        "'weight' [2, 3]",
        "[3, 3]",
    )
    return True


def test_mistakes_are_named() -> None:
    assert run_distributed(_mistakes, world_size=2, timeout=60) == [True, True]


def _single_process() -> list[Any]:
    hvd.shutdown()  # the harness made the group: shutdown() leaves it alone
    assert hvd.is_initialized()
    phalanx.destroy_process_group()
    assert not hvd.is_initialized()
    _raises(hvd.rank, "hvd.init()")
    hvd.init()
    hvd.init()
    model = nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    out = [hvd.size(), hvd.rank(), float(hvd.allreduce(torch.tensor(3.0)))]
    hvd.shutdown()
    return [*out, hvd.is_initialized()]


def test_init_is_idempotent_and_a_single_process_works() -> None:
    assert run_distributed(_single_process, world_size=1, timeout=60) == [[1, 0, 3.0, False]]


def test_facade_and_compression_need_no_process_group() -> None:
    from phalanx.data_parallel.sync_bn import SyncBatchNorm

    assert all(getattr(hvd, name) is not None for name in hvd.__all__)
    assert hvd.SyncBatchNorm is SyncBatchNorm
    x = torch.linspace(-2, 2, 7, dtype=torch.float64)
    wire, ctx = hvd.Compression.fp16.compress(x)
    assert wire.dtype == torch.float16
    _close(hvd.Compression.fp16.decompress(wire, ctx), x, "fp16 round trip", atol=1e-3)
    ints = torch.arange(3)
    assert hvd.Compression.fp16.compress(ints)[0] is ints
    assert hvd.Compression.none.compress(x)[0] is x
