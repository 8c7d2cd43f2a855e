"""backend="shm" groups take the call forms of torch's own groups, and work under autograd.

Code that holds a group object calls its methods the way torch's ``ProcessGroup`` takes them:
torch's DDP tests' hooks do ``dist.group.WORLD.allreduce(tensors)``, which for a Python backend
is the shm group itself. Each form runs on the shm default group and on a gloo group of the
same ranks, from the same inputs; the results must be equal. And a collective on a tensor that
requires grad (torch DDP's buckets under ``backward(create_graph=True)``) writes its data as
gloo does: before, the reduction's ``out=`` ops refused it, and torch's DDP crashed the process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import AllgatherOptions

from phalanx.testing import run_distributed

RED = dist.ReduceOp


def _forms(g: Any) -> dict[str, list[float]]:
    """Every form torch's ``ProcessGroup`` takes, each on fresh rank-dependent inputs."""
    r, n = dist.get_rank(), dist.get_world_size()

    def t(k: int = 4) -> torch.Tensor:
        return torch.arange(k, dtype=torch.float32) * (r + 2) + r

    out: dict[str, list[float]] = {}

    def done(name: str, work: Any, value: torch.Tensor | list[torch.Tensor]) -> None:
        work.wait()
        flat = torch.cat([v.reshape(-1) for v in value]) if isinstance(value, list) else value
        out[name] = flat.tolist()

    x = t()
    done("allreduce([t])", g.allreduce([x]), x)
    x = t()
    done("allreduce([t], MAX)", g.allreduce([x], RED.MAX), x)
    x = t()
    done("allreduce(t, MIN)", g.allreduce(x, RED.MIN), x)
    x, opts = t(), dist.AllreduceOptions()
    opts.reduceOp = RED.PRODUCT
    done("allreduce([t], opts)", g.allreduce([x], opts), x)
    x = t()
    fut = g.allreduce([x / n]).get_future().then(lambda f: f.value()[0] * 2)
    out["allreduce(...).get_future().then"] = fut.wait().tolist()
    x = t()
    done("broadcast(t, 1)", g.broadcast(x, 1), x)
    x = t()
    done("broadcast([t])", g.broadcast([x]), x)
    x = t()
    work = g.reduce(x, 1, RED.MAX)
    work.wait()
    out["reduce(t, 1, MAX) on root"] = x.tolist() if r == 1 else []
    outs = [torch.zeros(4) for _ in range(n)]
    done("allgather([o...], t)", g.allgather(outs, t()), outs)
    outs = [torch.zeros(4) for _ in range(n)]
    done("allgather([[o...]], [t], opts)", g.allgather([outs], [t()], AllgatherOptions()), outs)
    y = torch.zeros(4)
    done(
        "reduce_scatter(o, [i...], MAX)",
        g.reduce_scatter(y, [t() * q for q in range(n)], RED.MAX),
        y,
    )
    y = torch.zeros(4)
    done("reduce_scatter([o], [[i...]])", g.reduce_scatter([y], [[t() + q for q in range(n)]]), y)
    y = torch.zeros(4 * n)
    done("_allgather_base(o, t)", g._allgather_base(y, t()), y)
    y = torch.zeros(4)
    done("_reduce_scatter_base(o, i)", g._reduce_scatter_base(y, t(4 * n)), y)
    y = torch.zeros(4 * n)
    done("alltoall_base(o, i, [], [])", g.alltoall_base(y, t(4 * n), [], []), y)
    g.barrier().wait()
    g.barrier(timedelta(seconds=30)).wait()
    g.barrier(dist.BarrierOptions()).wait()
    return out


def _forms_on_both() -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    gloo = dist.new_group(backend="gloo")
    return _forms(dist.group.WORLD), _forms(gloo)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_call_form_of_torchs_groups_gives_gloos_results(world_size: int) -> None:
    for shm, gloo in run_distributed(
        _forms_on_both, world_size=world_size, backend="shm", timeout=60
    ):
        assert len(shm) == 15 and shm == gloo


def _bad_options() -> list[str]:
    g, x, said = dist.group.WORLD, torch.ones(2), []
    calls: list[Callable[[], Any]] = [
        lambda: g.allreduce([x], "sum"),
        lambda: g.broadcast([x], dist.AllreduceOptions()),
        lambda: g.barrier(3),
    ]
    for call in calls:
        with pytest.raises(TypeError) as e:
            call()
        said.append(str(e.value))
    g.barrier().wait()  # the group is still usable
    return said


def test_bad_options_are_refused_naming_the_call_and_the_value() -> None:
    said = run_distributed(_bad_options, world_size=2, backend="shm", timeout=60)[0]
    assert "allreduce: opts must be a AllreduceOptions" in said[0] and "'sum'" in said[0]
    assert "broadcast: opts must be a BroadcastOptions" in said[1]
    assert "barrier: opts must be a BarrierOptions" in said[2] and "got 3" in said[2]


class _Square(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor([1.0, 2.0, -3.0]))

    def forward(self) -> torch.Tensor:
        return (self.p.pow(2) * (dist.get_rank() + 1)).sum()


def _under_autograd() -> list[list[float]]:
    """torch's DDP with ``create_graph=True`` (torch's ``test_ddp_create_graph``), and an
    all_reduce of a tensor that requires grad."""
    ddp = nn.parallel.DistributedDataParallel(_Square())
    seen = []
    for _ in range(3):
        ddp().backward(create_graph=True)
        assert ddp.module.p.grad is not None and ddp.module.p.grad.requires_grad
        seen.append(ddp.module.p.grad.detach().clone().tolist())
    x = torch.ones(3, requires_grad=True) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    return [*seen, x.detach().tolist()]


def test_collectives_on_tensors_that_require_grad_work_as_on_gloo() -> None:
    shm = run_distributed(_under_autograd, world_size=2, backend="shm", timeout=60)
    assert shm == run_distributed(_under_autograd, world_size=2, backend="gloo", timeout=60)
    assert shm[0][-1] == [3.0, 3.0, 3.0] and shm[0][0] == [3.0, 6.0, -9.0]


def _call_timeout() -> tuple[float, str]:
    g = dist.group.WORLD
    start = time.monotonic()
    try:
        if dist.get_rank() == 1:
            time.sleep(4)
        g.barrier(timedelta(seconds=1)).wait()
        return time.monotonic() - start, ""
    except Exception as e:
        return time.monotonic() - start, str(e)


def test_a_calls_own_timeout_is_kept() -> None:
    (waited, said), (_, peer_said) = run_distributed(
        _call_timeout, world_size=2, backend="shm", timeout=60
    )
    assert "timed out after 1 s (the call's timeout)" in said and waited < 3.5, (waited, said)
    assert peer_said, "the late rank must not pass the barrier its peer gave up on"


def _functional(g: Any) -> list[list[float]]:
    import torch.distributed._functional_collectives as funcol

    x = torch.arange(6, dtype=torch.float32) + 10 * dist.get_rank()
    gathered = funcol.all_gather_tensor(x, 0, g)
    scattered = funcol.reduce_scatter_tensor(x * 2, "sum", 0, g)
    reduced = funcol.all_reduce(x + 1, "max", g)
    return [torch.as_tensor(t).tolist() for t in (gathered, scattered, reduced)]


def _functional_on_both() -> tuple[list[list[float]], list[list[float]], int]:
    shm = dist.group.WORLD
    before = shm._channel.calls  # type: ignore[union-attr]
    ours = _functional(shm)
    on_shm = shm._channel.calls - before  # type: ignore[union-attr]
    return ours, _functional(dist.new_group(backend="gloo")), on_shm


def test_functional_collectives_run_on_shared_memory() -> None:
    """torch's functional collectives (DTensor's path) on an shm group: gloo's results, and on
    the group's own calls, not the gloo group underneath (there, with the GIL held, they could
    deadlock with gloo's worker thread: tools/shm_dtensor_stall.py)."""
    for ours, gloo, on_shm in run_distributed(
        _functional_on_both, world_size=2, backend="shm", timeout=60
    ):
        assert ours == gloo and on_shm >= 3, (ours, gloo, on_shm)
