"""The strategies of the no-false-hang matrix, each as ``step(i)``: one real training step.

A family's cases are built on every rank in the same order (their process groups and
collectives must match) and stepped in turn by ``test_no_false_hangs``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import phalanx
import phalanx.horovod as hvd
from phalanx.data_parallel.hooks import (
    PowerSGDState,
    TopKState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    powerSGD_hook,
    topk_hook,
)
from phalanx.local_sgd import DiLoCoSync, LocalSGDSync, Outer, PeriodicSync, Replica
from phalanx.local_sgd.streaming import StreamingDiLoCoSync
from phalanx.models import GPT, GPTConfig
from phalanx.parameter_server import ParameterServer
from phalanx.pipeline import Pipeline
from phalanx.sharding import ZeroRedundancyOptimizer
from phalanx.sharding.zero3 import FullyShardedDataParallel
from phalanx.tensor_parallel import gpt_loss, parallelize_gpt

Step = Callable[[int], None]


def _mlp(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4)
    )


def _batch(i: int, rows: int = 8, width: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
    return torch.randn(rows, width, generator=g), torch.randn(rows, 4, generator=g)


def _trainer(model: nn.Module, opt: torch.optim.Optimizer) -> Step:
    def step(i: int) -> None:
        x, y = _batch(i)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return step


def _ddp(hook: Any = None, state: Any = None, bucket_cap_mb: float = 0.002) -> Step:
    model = phalanx.DistributedDataParallel(_mlp(), bucket_cap_mb=bucket_cap_mb)
    if hook is not None:
        model.register_comm_hook(state, hook)
    return _trainer(model, torch.optim.SGD(model.parameters(), lr=0.01))


def _ddp_join() -> Step:
    """Uneven inputs under ``ddp.join()``: rank 1 has one batch more each step."""
    model = phalanx.DistributedDataParallel(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(i: int) -> None:
        with model.join():
            for j in range(2 + dist.get_rank()):
                x, y = _batch(10 * i + j)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()

    return step


def ddp_cases() -> dict[str, Step]:
    """phalanx DDP with no hook, each hook phalanx ships, torch's hooks, and ``join()``."""
    return {
        "ddp": _ddp(),
        "allreduce_hook": _ddp(allreduce_hook),
        "fp16_compress_hook": _ddp(fp16_compress_hook),
        "bf16_compress_hook": _ddp(bf16_compress_hook),
        "powerSGD_hook": _ddp(powerSGD_hook, PowerSGDState(start_powerSGD_iter=2)),
        "topk_hook": _ddp(topk_hook, TopKState(ratio=0.1, start_iter=2)),
        "torch.allreduce_hook": _ddp(torch_hooks.allreduce_hook),
        "torch.fp16_compress_hook": _ddp(torch_hooks.fp16_compress_hook),
        "torch.bf16_compress_hook": _ddp(torch_hooks.bf16_compress_hook),
        # One bucket: torch's PowerSGD issues collectives from future callbacks, so with several
        # buckets on gloo the ranks' orders differ (torch's own DDP hangs so too).
        "torch.powerSGD_hook": _ddp(
            torch_powersgd.powerSGD_hook,
            torch_powersgd.PowerSGDState(None, start_powerSGD_iter=2),
            bucket_cap_mb=25.0,
        ),
        "ddp.join": _ddp_join(),
    }


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


def _zero3() -> Step:
    torch.manual_seed(0)
    net = nn.Sequential(_Block(), _Block(), nn.Linear(16, 4))
    model = FullyShardedDataParallel(net, wrap=_Block)  # prefetches the next unit
    return _trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def _zero(stage: int) -> Step:
    model = _mlp()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, stage=stage, bucket_cap_mb=0.002, lr=1e-3
    )
    return _trainer(model, opt)


def zero_cases() -> dict[str, Step]:
    """ZeRO-1, ZeRO-2 (optimizer and gradient sharding), ZeRO-3 (parameter sharding)."""
    return {"zero1": _zero(1), "zero2": _zero(2), "zero3": _zero3()}


def pipeline_step(schedule: str, chunks: int = 1, p2p: str | None = None) -> Step:
    """A 2-stage pipeline of 8 layers with its optimizer, on a group of its own."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 16) if k % 2 == 0 else nn.Tanh() for k in range(8)]
    group = dist.new_group([0, 1])  # one group per pipeline: their tags never meet
    pipe = Pipeline(
        layers,
        group,
        schedule=schedule,
        micro_batches=4,
        loss_fn=nn.functional.mse_loss,
        chunks=chunks,
        p2p=p2p,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        opt.zero_grad()
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        opt.step()

    return step


def pipeline_cases() -> dict[str, Step]:
    """Each schedule over 2 stages (eager P2P, gloo's default), and 1F1B with grouped P2P."""
    return {
        "gpipe": pipeline_step("gpipe"),
        "1f1b": pipeline_step("1f1b"),
        "interleaved": pipeline_step("interleaved", chunks=2),
        "1f1b.grouped": pipeline_step("1f1b", p2p="grouped"),
    }


def tensor_cases() -> dict[str, Step]:
    """A GPT with every layer split over the 2 ranks (vocabulary-parallel loss)."""
    torch.manual_seed(0)
    model = parallelize_gpt(GPT(GPTConfig(65, 16, 2, 4, 32)), None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(65, (4, 17), generator=g)
        opt.zero_grad()
        gpt_loss(model, ids[:, :-1], ids[:, 1:])[1].backward()
        opt.step()

    return {"tensor": step}


def _hvd_join() -> Step:
    """Uneven inputs: rank r takes 1 + r optimizer steps per round, then ``hvd.join()``."""
    model = _mlp()
    named = [(f"join.{n}", p) for n, p in model.named_parameters()]
    train = _trainer(
        model,
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=named
        ),
    )

    def step(i: int) -> None:
        for j in range(1 + dist.get_rank()):
            train(10 * i + j)
        hvd.join()

    return step


def horovod_cases() -> dict[str, Step]:
    """Horovod's DistributedOptimizer, allreduce_async / poll / synchronize, and join."""
    model = _mlp()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def handles(i: int) -> None:
        handle = hvd.allreduce_async(torch.full((64,), float(i)), name=f"t{i}")
        while not hvd.poll(handle):
            time.sleep(0.001)
        hvd.synchronize(handle)

    return {
        "DistributedOptimizer": _trainer(model, opt),
        "allreduce_async": handles,
        "join": _hvd_join(),
    }


def replica_sync(kind: str, compute_s: float = 0.0, overlap: int = 1) -> tuple[Step, PeriodicSync]:
    """A step of an MLP's own AdamW, then LocalSGD's, DiLoCo's (int8) or streaming DiLoCo's
    (2 fragments, each average in flight during the next ``overlap`` steps) schedule, H = 2;
    each step also computes for ``compute_s`` seconds (a sleep). Returns the step and the
    synchronisation (whose ``finish()`` waits for an average still in flight)."""
    model = _mlp()
    replica = Replica.of(model)
    sync: LocalSGDSync | DiLoCoSync
    if kind == "localsgd":
        sync = LocalSGDSync(replica, None, 2)
    elif kind == "diloco":
        sync = DiLoCoSync(replica, None, 2, Outer(codec="int8"))
    else:
        sync = StreamingDiLoCoSync(
            replica, None, 2, Outer(codec="int8"), fragments=2, overlap=overlap
        )
    train = _trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(i: int) -> None:
        time.sleep(compute_s)
        train(i)
        sync.after_step()

    return step, sync


def replica_cases() -> dict[str, Step]:
    """Training over slow links (issue 20): collectives only every H steps (streaming without
    overlap: the matrix stops at any step, with nothing in flight; see the overlap test)."""
    return {kind: replica_sync(kind, overlap=0)[0] for kind in ("localsgd", "diloco", "streaming")}


def parameter_server(mode: str, seconds: float, extra: float = 0.0) -> tuple[float, int]:
    """One parameter-server job (rank 0 serves, ranks 1-2 work) for ``seconds``, rank 2 for
    ``extra`` seconds more (rank 1 waits for the final parameters meanwhile): its span, and the
    steps this rank took."""
    model = _mlp()
    make = lambda ps: torch.optim.SGD(ps.values(), lr=0.01)  # noqa: E731
    bound = 2 if mode == "ssp" else None
    ps = ParameterServer(model, make, mode=mode, bound=bound, heartbeat=0.5, dead_after=5.0)
    start = time.monotonic()
    if ps.is_server:
        ps.serve()
        return time.monotonic() - start, 0
    assert ps.worker is not None
    if dist.get_rank() == 2:
        seconds += extra
    while time.monotonic() - start < seconds and ps.pull():
        x, y = _batch(ps.worker.clock)
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        ps.push()
    ps.close()
    return time.monotonic() - start, ps.worker.clock
