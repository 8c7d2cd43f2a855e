"""Bad input gets a clear error, everywhere: one table over the public API and the CLI.

Each row is a call, the exception type it must raise and words its message must hold (the
argument's name and the offending value at least). Every row must also raise within its
deadline, start no process, thread or socket, and raise from phalanx's own code: no frame of
the exception (nor of the exceptions it chains) lies inside torch or urllib. CLI rows run
``phalanx`` as a subprocess whose script would touch a marker file: it must not exist.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch
from torch import nn

import phalanx
import phalanx.horovod as hvd
from phalanx import checkpoint, hogwild
from phalanx._check import check_bool, check_float, check_int, check_timeout
from phalanx.data.eval import EvalSampler
from phalanx.parameter_server import ParameterServer
from phalanx.pipeline import Pipeline, schedule
from phalanx.plan.memory import estimate
from phalanx.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallelize_module,
)
from phalanx.train import register_strategy

DEADLINE_S = 10.0
"""Per API row: far above the slowest row (the 1 s connect timeout), far below a hang."""
CLI_DEADLINE_S = 60.0
FOREIGN = tuple(Path(m.__file__).resolve().parent for m in (torch, urllib))
"""Packages no frame of a raised exception may be in (phalanx's own frames must raise)."""
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
OTHER_ENV = (
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "PHALANX_BACKEND",
    "PHALANX_DEBUG",
    "PHALANX_MISMATCH_CHECK",
    "PHALANX_CALL_SITES",
    "PHALANX_HANG_TIMEOUT",
)
NOWHERE = str(Path(tempfile.gettempdir()) / "phalanx-bad-input-never-written")


class Fresh:
    """An argument built anew for each call (a model, an optimizer), shown by its name."""

    def __init__(self, name: str, make: Callable[[], object]) -> None:
        self.name, self.make = name, make

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Call:
    """``fn(*args, **kwargs)``; its repr is what the user typed (the row's id)."""

    fn: Callable[..., object]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __call__(self) -> object:
        return self.fn(*_made(self.args), **dict(zip(self.kwargs, _made(self.kwargs.values()))))

    def __repr__(self) -> str:
        shown = [_shown(a) for a in self.args] + [
            f"{k}={_shown(v)}" for k, v in self.kwargs.items()
        ]
        return f"{getattr(self.fn, '__qualname__', self.fn)}({', '.join(shown)})"


def _shown(value: Any) -> str:
    """A value as typed: functions by name (their repr holds an address, which differs between
    processes, and test ids must not: pytest-xdist compares them)."""
    if callable(value) and hasattr(value, "__qualname__") and not isinstance(value, type):
        return str(value.__qualname__)
    return repr(value)


def _made(values: Iterable[Any]) -> list[Any]:
    """``values`` with every :class:`Fresh` made (in lists too)."""
    return [
        v.make() if isinstance(v, Fresh) else _made(v) if isinstance(v, list) else v for v in values
    ]


def bad(fn: Callable[..., object], *args: Any, **kwargs: Any) -> Call:
    return Call(fn, args, kwargs)


@dataclass(frozen=True)
class Case:
    """One bad call and what it must raise: the type, and words of the message."""

    call: Call | None
    error: type[BaseException]
    words: tuple[str, ...]
    """Besides ``name=value`` of the call's last keyword argument: the offending one."""
    cli: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    group: bool = False
    """Run inside a one-process group (collectives, FSDP, tensor parallel, horovod)."""

    @property
    def id(self) -> str:
        if self.cli:
            return "phalanx " + " ".join(self.cli)
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{env} {self.call!r}" if env else repr(self.call)

    def expected(self) -> list[str]:
        named = [] if self.call is None else list(self.call.kwargs.items())[-1:]
        return [f"{k}={v!r}" for k, v in named] + list(self.words)


def row(call: Call, error: type[BaseException], words: str = "", **options: Any) -> Case:
    """A table row; ``words`` are separated by " | "."""
    return Case(call, error, tuple(w for w in words.split(" | ") if w), **options)


def cli(line: str, words: str) -> Case:
    """``phalanx LINE`` (``run`` gets a script that would touch a marker) must exit non-zero."""
    return Case(None, SystemExit, tuple(words.split(" | ")), cli=tuple(line.split()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(_mlp().parameters(), lr=0.1)


def _epochs(n: Any) -> object:
    with Job("single") as job:
        return list(job.epochs(n))


def _slow_down(who: Any, factor: Any) -> None:
    with Job("single") as job:
        job.slow_down(who, factor)


def _clip(max_norm: Any, norm_type: Any = 2.0) -> None:
    with Job("single") as job:
        job.setup(_mlp())
        job.clip_grad_norm_(max_norm, norm_type)


def _schedule(schedule: Any, plateau: bool = False) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched: Any = torch.optim.lr_scheduler.StepLR(opt, 1)
    if plateau:
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with Job("single") as job:
        job.setup(model, opt, sched, schedule=schedule)


def _track(name: Any, obj: Any = None, twice: bool = False) -> None:
    with Job("single") as job:
        if twice:
            job.track(name, torch.optim.SGD(_mlp().parameters(), lr=0.1))
        job.track(name, torch.optim.SGD(_mlp().parameters(), lr=0.1) if obj is None else obj)


def _gather(value: Any) -> None:
    with Job("single") as job:
        job.gather(value)


def _loader(**kwargs: Any) -> None:
    with Job("single") as job:
        job.loader([1, 2, 3], 2, **kwargs)


def _main_first(group: Any) -> None:
    with phalanx.main_first(group):
        pass


def _train(rank: int, model: nn.Module, shard: object) -> None:
    """A picklable hogwild train_fn (never reached: every row fails before a process starts)."""


NOBODY = Fresh("'tcp://127.0.0.1:<free port>'", lambda: f"tcp://127.0.0.1:{_free_port()}")
MLP = Fresh("mlp", _mlp)
PARAMS = Fresh("mlp.parameters()", lambda: _mlp().parameters())
SGD_OPT = Fresh("sgd", _sgd)
T = Fresh("t", lambda: torch.ones(2))
SGD = torch.optim.SGD
mse = nn.functional.mse_loss
init = phalanx.init_process_group
Job = phalanx.Job
Zero, Mesh, PS, DDPOptions = phalanx.Zero, phalanx.Mesh, phalanx.PS, phalanx.DDP
DDP = phalanx.DistributedDataParallel
DP = phalanx.DataParallel
SBN = phalanx.SyncBatchNorm
Sampler = phalanx.DistributedSampler
ZeRO = phalanx.ZeroRedundancyOptimizer
FSDP = phalanx.FullyShardedDataParallel
TWO = {"rank": 0, "world_size": 2}
ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}

CASES = [
    # ---- init_process_group: init_method (parsed before anything starts) -------------------
    row(bad(init, **TWO, init_method="tcp://h:99999"), ValueError, "port '99999' | 1..65535"),
    row(bad(init, **TWO, init_method="tcp://h:abc"), ValueError, "port 'abc' | tcp://HOST:PORT"),
    row(bad(init, world_size=2, init_method="tcp://h:1?rank=x"), ValueError, "rank='x'"),
    row(bad(init, init_method="tcp://h:1?world_size=0"), ValueError, "world_size='0'"),
    row(bad(init, **TWO, init_method="tcp://h"), ValueError, "no port | tcp://HOST:PORT"),
    row(bad(init, **TWO, init_method="tcp://:29500"), ValueError, "no host"),
    row(bad(init, **TWO, init_method="tcp://[::1:5"), ValueError, "not a URL"),
    row(bad(init, **TWO, init_method="tcp://h:1?size=2"), ValueError, "unknown query | size"),
    row(bad(init, init_method="udp://x:1"), ValueError, "unknown scheme 'udp' | env://"),
    row(bad(init, **TWO, init_method="file://"), ValueError, "no file path | file:///"),
    row(bad(init, init_method=5), TypeError, "str | int 5"),
    # ---- init_process_group: the other arguments -------------------------------------------
    row(bad(init, backend="carrier-pigeon"), ValueError, "'gloo'"),
    row(bad(init, backend=3), TypeError, "int 3"),
    row(bad(init, world_size=2, rank="0"), TypeError, "str '0'"),
    row(bad(init, world_size=2, rank=-1), ValueError, "int >= 0"),
    row(bad(init, world_size=2, rank=3), ValueError, "0..1"),
    row(bad(init, world_size=0), ValueError, "int >= 1"),
    row(bad(init, rank=0, world_size=2.0), TypeError, "float 2.0"),
    row(bad(init, timeout=-1), ValueError, "positive number of seconds"),
    row(bad(init, timeout="5"), TypeError, "str '5' | timedelta"),
    row(bad(init, timeout=math.nan), ValueError, "positive"),
    row(bad(init, timeout=True), TypeError, "bool True"),
    row(bad(init, validate="yes"), TypeError, "True or False"),
    # ---- init_process_group(): a bad launcher environment ----------------------------------
    row(bad(init), ValueError, "RANK='x' | integer", env={"RANK": "x", "WORLD_SIZE": "2"}),
    row(bad(init), ValueError, "WORLD_SIZE='0' | >= 1", env={"RANK": "0", "WORLD_SIZE": "0"}),
    row(
        bad(init), ValueError, "MASTER_PORT='99999' | 1..65535", env=ENV | {"MASTER_PORT": "99999"}
    ),
    row(bad(init), ValueError, "MASTER_PORT='abc' | integer", env=ENV | {"MASTER_PORT": "abc"}),
    row(
        bad(init),
        ValueError,
        "rank=3 | world_size=2 | environment",
        env={"RANK": "3", "WORLD_SIZE": "2"},
    ),
    row(bad(init, **TWO, init_method="env://"), ValueError, "MASTER_ADDR"),
    row(bad(init), ValueError, "PHALANX_BACKEND='foo' | unset", env={"PHALANX_BACKEND": "foo"}),
    # ---- init_process_group(): a bad tracking flag, refused before rendezvous, at any size ----
    row(
        bad(init),
        ValueError,
        "PHALANX_MISMATCH_CHECK='maybe' | 1/0",
        env={"PHALANX_MISMATCH_CHECK": "maybe"},
    ),
    row(bad(init), ValueError, "PHALANX_CALL_SITES='2' | on/off", env={"PHALANX_CALL_SITES": "2"}),
    row(
        bad(init),
        ValueError,
        "PHALANX_DEBUG='verbose' | true/false",
        env={"PHALANX_DEBUG": "verbose"},
    ),
    row(
        bad(init),
        ValueError,
        "PHALANX_HANG_TIMEOUT='soon' | seconds",
        env={"PHALANX_HANG_TIMEOUT": "soon"},
    ),
    row(
        bad(init), ValueError, "PHALANX_HANG_TIMEOUT='-1' | > 0", env={"PHALANX_HANG_TIMEOUT": "-1"}
    ),
    row(
        bad(init, "gloo", NOBODY),
        ValueError,
        "PHALANX_MISMATCH_CHECK='Nope' | yes/no",
        env={"RANK": "1", "WORLD_SIZE": "2", "PHALANX_MISMATCH_CHECK": "Nope"},
    ),
    row(
        bad(init, "gloo", NOBODY, rank=1, world_size=2, timeout=1),
        ConnectionError,
        "rendezvous store at 127.0.0.1: | within timeout=1 s | raise timeout=",
    ),
    # ---- Job: every option, before the job makes its process group -------------------------
    row(bad(Job, "single", grad_accum="4"), TypeError, "Job(grad_accum='4') | int >= 1 | str '4'"),
    row(bad(Job, "single", grad_accum=2.5), TypeError, "int >= 1 | float 2.5"),
    row(bad(Job, "single", grad_accum=0), ValueError, "int >= 1"),
    row(bad(Job, "single", grad_accum=True), TypeError, "bool True"),
    row(bad(Job, "single", seed="x"), TypeError, "an int"),
    row(bad(Job, "single", seed=1.5), TypeError, "float 1.5"),
    row(bad(Job, strategy="ddpp"), ValueError, "'ddp' | 'zero2'"),
    row(bad(Job, strategy=3), TypeError, "int 3"),
    row(
        bad(Job, "single", precision="fp64"),
        ValueError,
        "'bf16-mixed', 'fp16-mixed', 'bf16-true', got",
    ),
    row(bad(Job, "single", keep_last=0), ValueError, "int >= 1"),
    row(bad(Job, "single", precision="fp16-master"), ValueError, "'bf16-mixed' | plan"),
    row(bad(Job, "single", precision="mixed"), ValueError, "'mixed' means 'fp16-master' | plan"),
    row(bad(Job, "single", precision=16), TypeError, "int 16 | 'bf16-true'"),
    row(bad(Job, "single", seed=2.5), TypeError, "float 2.5"),
    row(bad(_gather, value="x"), TypeError, "Job.gather | a tensor or a number | str 'x'"),
    row(bad(_loader, shuffle=False, eval=True, sampler=[0]), ValueError, "own sampler"),
    row(bad(_loader, eval=True, shuffle="no"), TypeError, "EvalSampler | True or False"),
    row(bad(EvalSampler, [1, 2], num_replicas=2, rank=2), ValueError, "[0, num_replicas)"),
    row(bad(EvalSampler, [1], rank=0, num_replicas=0), ValueError, "int >= 1"),
    row(bad(EvalSampler, 5, 1, 0), TypeError, "map-style dataset"),
    row(bad(estimate, 1e9, 8, precision="bf17"), ValueError, "'bf16-true', 'fp16-master', got"),
    row(bad(Job, "single", checkpoint_dir=3), TypeError, "a path"),
    row(bad(Job, "single", metrics_file=""), ValueError, "non-empty"),
    row(bad(Job, "single", profile_dir=b"p"), TypeError, "bytes"),
    row(bad(Job, "single", tensorboard_dir=5), TypeError, "a path"),
    row(bad(Job, "ssp"), ValueError, "PS(mode='ssp') | staleness bound"),
    row(bad(_slow_down, who=1, factor=0.5), ValueError, "Job.slow_down(factor=0.5) | >= 1"),
    row(bad(_slow_down, factor=2.0, who="x"), TypeError, "who='x' | 'random'"),
    row(bad(_slow_down, factor=2.0, who=-1), ValueError, "int >= 0"),
    # ---- strategy options: checked where they are built, naming the class --------------------
    row(bad(Mesh, pp=2, schedule="zigzag"), ValueError, "Mesh(schedule='zigzag') | '1f1b'"),
    row(bad(Mesh, pp=2, micro_batches=0), ValueError, "micro_batches | int >= 1"),
    row(bad(Mesh, pp=2, chunks="2"), TypeError, "chunks='2' | str '2'"),
    row(bad(Mesh, dp=0), ValueError, "Mesh(dp=0) | int >= 1"),
    row(bad(Mesh, pp=1.5), TypeError, "float 1.5"),
    row(bad(Mesh, tp="2"), TypeError, "str '2'"),
    row(bad(Mesh, pp=2, balance=[1, "a"]), TypeError, "balance[1] | str 'a'"),
    row(bad(Mesh, pp=2, balance="fast"), ValueError, "'params'"),
    row(bad(Mesh, tp=2, tp_plan={"fc": "diagonal"}), ValueError, "tp_plan['fc'] | 'rowwise'"),
    row(bad(Mesh, tp=2, tp_plan=["fc"]), TypeError, "a dict"),
    row(bad(Mesh, dp=2, pp=None, tp=None), ValueError, "pp=None, tp=None | at most one"),
    row(bad(PS, mode="fast"), ValueError, "PS(mode='fast') | 'ssp'"),
    row(bad(PS, staleness_lr="yes"), TypeError, "True or False"),
    row(bad(PS, mode="ssp", staleness=-1), ValueError, "int >= 0"),
    row(bad(PS, staleness=2), ValueError, "PS(staleness=2) | mode='ssp'"),
    row(bad(PS, servers="1"), TypeError, "str '1'"),
    row(bad(PS, max_updates=0), ValueError, "int >= 1"),
    row(bad(Zero, stage=4), ValueError, "Zero(stage=4) | int in 1..3"),
    row(bad(Zero, stage="2"), TypeError, "str '2'"),
    row(bad(Zero, stage=3, bucket_cap_mb=10), ValueError, "bucket_cap_mb=10 | stages 1 and 2"),
    row(bad(Zero, init_sync="no"), TypeError, "Zero(init_sync='no') | True or False"),
    row(bad(Zero, stage=2, mirror_every=0), ValueError, "Zero(mirror_every=0) | int >= 1"),
    row(bad(DDPOptions, bucket_cap_mb=0), ValueError, "DDP(bucket_cap_mb=0) | > 0"),
    row(bad(DDPOptions, find_unused_parameters="no"), TypeError, "True or False"),
    row(bad(Job, "single", straggler_check_every=-1), ValueError, "int >= 0"),
    row(bad(Job, "single", straggler_rule=5), TypeError, "StragglerRule | int 5"),
    row(bad(Job, "single", straggler_rule={"z": 3.0}), TypeError, "StragglerRule | dict"),
    row(bad(Job, backend="tpu"), ValueError, "'gloo'"),
    row(bad(_epochs, n="3"), TypeError, "Job.epochs | str '3'"),
    row(bad(_clip, max_norm=0), ValueError, "Job.clip_grad_norm_ | > 0"),
    row(bad(_clip, max_norm="1"), TypeError, "a number | str '1'"),
    row(bad(_clip, max_norm=1.0, norm_type=-2.0), ValueError, "> 0 | float('inf')"),
    row(bad(_schedule, schedule="batch"), ValueError, "Job.setup | 'step', 'epoch', 'manual'"),
    row(bad(_schedule, plateau=True, schedule="step"), ValueError, "ReduceLROnPlateau | 'manual'"),
    row(bad(_track, name=""), ValueError, "Job.track | non-empty"),
    row(bad(_track, name=3), TypeError, "Job.track | int 3"),
    row(bad(_track, name="x", obj=3), TypeError, "state_dict() | tracking 'x'"),
    row(bad(_track, twice=True, name="x"), ValueError, "tracked as 'x' already"),
    row(bad(register_strategy, "mine", strategy=3), TypeError, "Strategy subclass or instance"),
    row(bad(register_strategy, "mine", strategy=print), TypeError, "builtin_function"),
    row(bad(register_strategy, strategy=Zero, name=None), TypeError, "a non-empty str"),
    # ---- DistributedDataParallel (checked before it even looks for a process group) --------
    row(bad(DDP, MLP, bucket_cap_mb="25"), TypeError, "str '25' | MiB"),
    row(bad(DDP, MLP, bucket_cap_mb=0), ValueError, "> 0 | MiB"),
    row(bad(DDP, MLP, bucket_cap_mb_list=[1, "2"]), TypeError, "bucket_cap_mb_list[1] | str '2'"),
    row(bad(DDP, MLP, device_ids=0), TypeError, "a list"),
    row(bad(DDP, MLP, device_ids="cuda:0"), TypeError, "a list"),
    row(bad(DDP, MLP, device_ids=[0.5]), TypeError, "device_ids[0] | float 0.5"),
    row(bad(DDP, MLP, output_device=1.5), TypeError, "torch.device"),
    row(bad(DDP, MLP, broadcast_buffers="no"), TypeError, "True or False"),
    row(bad(DDP, MLP, gradient_as_bucket_view=2), TypeError, "int 2"),
    row(bad(DDP, MLP, find_unused_parameters="yes"), TypeError, "True or False"),
    row(bad(DDP, MLP, static_graph=None), TypeError, "got None"),
    row(bad(DDP, MLP, dim="0"), TypeError, "an int"),
    row(bad(DDP, module=3), TypeError, "nn.Module"),
    row(bad(DDP, MLP, process_group=3), TypeError, "ProcessGroup"),
    row(bad(DDP, MLP, init_sync="no"), TypeError, "True or False"),
    # ---- DataParallel, SyncBatchNorm -------------------------------------------------------
    row(bad(DP, module=3), TypeError, "nn.Module"),
    row(bad(DP, MLP, dim="0"), TypeError, "batch dimension"),
    row(bad(DP, MLP, device_ids="cpu"), TypeError, "a list of devices"),
    row(bad(DP, MLP, device_ids=[]), ValueError, "non-empty | None"),
    row(bad(DP, MLP, device_ids=["cpu", 1.5]), TypeError, "device_ids[1]"),
    row(bad(SBN, num_features="4"), TypeError, "int >= 1"),
    row(bad(SBN, num_features=0), ValueError, "int >= 1"),
    row(bad(SBN, 4, eps=-1.0), ValueError, ">= 0"),
    row(bad(SBN, 4, momentum=2), ValueError, "0..1"),
    row(bad(SBN, 4, affine="yes"), TypeError, "True or False"),
    row(bad(SBN, 4, process_group="world"), TypeError, "ProcessGroup"),
    row(bad(SBN.convert_sync_batchnorm, module=3), TypeError, "nn.Module"),
    # ---- DistributedSampler ----------------------------------------------------------------
    row(bad(Sampler, range(8), rank=0, num_replicas="2"), TypeError, "str '2'"),
    row(bad(Sampler, range(8), num_replicas=2, rank=2), ValueError, "[0, num_replicas)"),
    row(bad(Sampler, range(8), num_replicas=2, rank=-1), ValueError, "[0, num_replicas)"),
    row(bad(Sampler, range(8), num_replicas=0, rank=0), ValueError, "num_replicas >= 1"),
    row(bad(Sampler, range(8), 2, 0, shuffle="no"), TypeError, "True or False"),
    row(bad(Sampler, range(8), 2, 0, seed="x"), TypeError, "an int"),
    row(bad(Sampler, range(8), 2, 0, drop_last=2), TypeError, "int 2"),
    row(bad(Sampler, range(8), 2, 0, batch_size=0), ValueError, "int >= 1"),
    row(bad(Sampler, num_replicas=2, rank=0, dataset=3), TypeError, "map-style"),
    row(bad(Sampler(range(8), 2, 0).set_epoch, epoch="1"), TypeError, "set_epoch"),
    # ---- ZeroRedundancyOptimizer -----------------------------------------------------------
    row(bad(ZeRO, PARAMS, optimizer_class=3), TypeError, "Optimizer subclass"),
    row(bad(ZeRO, PARAMS, SGD, lr="0.1"), TypeError, "a number"),
    row(bad(ZeRO, PARAMS, SGD, parameters_as_bucket_view="yes"), TypeError, "True or False"),
    row(bad(ZeRO, PARAMS, SGD, overlap_with_ddp="no"), TypeError, "True or False"),
    row(bad(ZeRO, PARAMS, SGD, lr=0.1, broadcast_params="no"), TypeError, "broadcast_params="),
    row(bad(ZeRO, PARAMS, SGD, lr=0.1, stage=3), ValueError, "FullyShardedDataParallel"),
    row(bad(ZeRO, PARAMS, SGD, lr=0.1, bucket_cap_mb=-1), ValueError, "> 0"),
    row(bad(ZeRO, PARAMS, SGD, lr=0.1, process_group=3), TypeError, "ProcessGroup"),
    row(bad(ZeRO, optimizer_class=SGD, params=3), TypeError, "params must be | int 3"),
    # ---- Pipeline and schedules ------------------------------------------------------------
    row(bad(Pipeline, MLP, None, loss_fn=mse, micro_batches=0), ValueError, "int >= 1"),
    row(
        bad(Pipeline, MLP, None, micro_batches=2, loss_fn=mse, schedule="pipedream"),
        ValueError,
        "'gpipe'",
    ),
    row(bad(Pipeline, MLP, None, micro_batches=2, loss_fn=3), TypeError, "callable"),
    row(bad(Pipeline, group=None, micro_batches=2, loss_fn=mse, layers=3), TypeError, "list"),
    row(bad(Pipeline, MLP, None, micro_batches=2, loss_fn=mse, p2p="fast"), ValueError, "'eager'"),
    row(bad(Pipeline, MLP, None, micro_batches=2, loss_fn=mse, balance=[0]), ValueError, ">= 1"),
    row(bad(schedule, "gpipe", 2, 4, 2), ValueError, "stage must be an int in 0..1 | int 2"),
    row(bad(schedule, "gpipe", 2, "4", 0), TypeError, "num_microbatches | str '4'"),
    # ---- parameter server, hogwild ---------------------------------------------------------
    row(bad(ParameterServer, MLP, _sgd, mode="fast"), ValueError, "'ssp'"),
    row(bad(ParameterServer, MLP, _sgd, num_servers=0), ValueError, "int >= 1"),
    row(bad(ParameterServer, MLP, _sgd, heartbeat=0), ValueError, "> 0"),
    row(bad(ParameterServer, MLP, make_optimizer=3), TypeError, "callable"),
    row(bad(ParameterServer, MLP, _sgd, mode="ssp", bound=-1), ValueError, "int >= 0"),
    row(bad(hogwild.train, MLP, train_fn=print, num_processes=0), ValueError, "int >= 1"),
    row(bad(hogwild.train, MLP, _train, 2, start_method="fork"), ValueError, "deadlock"),
    row(bad(hogwild.train, MLP, _train, 2, timeout=0), ValueError, "> 0"),
    row(bad(hogwild.train, train_fn=_train, num_processes=2, model=3), TypeError, "nn.Module"),
    row(bad(hogwild.train, MLP, _train, 2, args=[1]), TypeError, "tuple"),
    row(
        bad(hogwild.train, MLP, lambda *a: None, 2),
        TypeError,
        "train_fn= | lambda | define it at module level",
    ),
    # ---- checkpoints -----------------------------------------------------------------------
    row(bad(checkpoint.save, NOWHERE, step=-1), ValueError, "save(step=-1) | int >= 0"),
    row(bad(checkpoint.save, NOWHERE, step="1"), TypeError, "str '1'"),
    row(bad(checkpoint.save, NOWHERE, 1, keep_last=0), ValueError, "None to keep all"),
    row(bad(checkpoint.save, step=1, directory=3), TypeError, "a path"),
    row(bad(checkpoint.save, NOWHERE, 1, model=3), TypeError, "nn.Module or an object with"),
    row(bad(checkpoint.save, NOWHERE, 1, optimizer="adam"), TypeError, "state_dict()"),
    row(bad(checkpoint.save, NOWHERE, 1, extra=[1]), TypeError, "a dict"),
    row(bad(checkpoint.save, NOWHERE, 1, group=3), TypeError, "ProcessGroup"),
    row(bad(checkpoint.load, NOWHERE, strict="yes"), TypeError, "True or False"),
    row(bad(checkpoint.load, directory=None), TypeError, "a path"),
    row(bad(checkpoint.load, NOWHERE, sampler=3), TypeError, "load_state_dict()"),
    row(bad(checkpoint.load, NOWHERE, path=7), TypeError, "a path"),
    row(bad(checkpoint.latest, directory=3), TypeError, "a path"),
    # ---- collectives (in a one-process group, but for the first row) -----------------------
    row(bad(phalanx.all_reduce, T), ValueError, "all_reduce | init_process_group()"),
    row(bad(_main_first, group="world"), TypeError, "main_first | ProcessGroup"),
    row(bad(phalanx.all_reduce, tensor=3), TypeError, "torch.Tensor", group=True),
    row(bad(phalanx.all_reduce, T, op="sum"), TypeError, "ReduceOp", group=True),
    row(bad(phalanx.all_reduce, T, algorithm="fast"), ValueError, "'ring'", group=True),
    row(bad(phalanx.all_reduce, T, async_op="yes"), TypeError, "True or False", group=True),
    row(bad(phalanx.broadcast, T, src="0"), TypeError, "str '0'", group=True),
    row(bad(phalanx.broadcast, T, src=5), ValueError, "0..0", group=True),
    row(bad(phalanx.send, T, dst=5), ValueError, "0..0", group=True),
    row(bad(phalanx.send, T, 0, tag="x"), TypeError, "an int", group=True),
    row(bad(phalanx.recv, T, src=-1), ValueError, "0..0", group=True),
    row(bad(phalanx.reduce, T, dst=1), ValueError, "0..0", group=True),
    row(bad(phalanx.gather, T, dst="0"), TypeError, "str '0'", group=True),
    row(bad(phalanx.scatter, T, scatter_list=T), TypeError, "a list of tensors", group=True),
    row(bad(phalanx.barrier, group=3), TypeError, "ProcessGroup", group=True),
    row(bad(phalanx.all_gather, tensor=T, tensor_list=3), TypeError, "list of tensors", group=True),
    row(bad(phalanx.all_gather, [T, 3], T), TypeError, "tensor_list[1] | int 3", group=True),
    row(bad(phalanx.reduce_scatter_tensor, T, input=[1]), TypeError, "torch.Tensor", group=True),
    row(bad(phalanx.batch_isend_irecv, [3]), TypeError, "p2p_op_list[0]=3 | P2POp", group=True),
    row(bad(phalanx.all_gather_object, obj=1, object_list=3), TypeError, "a list", group=True),
    row(
        bad(phalanx.all_gather_object, obj=1, object_list=[]),
        ValueError,
        "one entry per rank",
        group=True,
    ),
    row(bad(phalanx.broadcast_object_list, [1], src=2), ValueError, "0..0", group=True),
    row(bad(phalanx.gather_object, 1, [None], dst="0"), TypeError, "str '0'", group=True),
    row(
        bad(phalanx.scatter_object_list, scatter_object_output_list=[]),
        ValueError,
        "room for one object",
        group=True,
    ),
    # ---- FSDP, tensor parallel, horovod (in a one-process group) ----------------------------
    row(bad(FSDP, module=3), TypeError, "nn.Module", group=True),
    row(bad(FSDP, MLP, prefetch="yes"), TypeError, "True or False", group=True),
    row(bad(FSDP, MLP, param_dtype="bf16"), TypeError, "torch.dtype", group=True),
    row(
        bad(ColumnParallelLinear, out_features=8, group=None, in_features="4"),
        TypeError,
        "ColumnParallelLinear(in_features='4')",
        group=True,
    ),
    row(
        bad(RowParallelLinear, 4, 8, group=None, bias="yes"), TypeError, "True or False", group=True
    ),
    row(
        bad(VocabParallelEmbedding, embedding_dim=4, group=None, num_embeddings=0),
        ValueError,
        "int >= 1",
        group=True,
    ),
    row(
        bad(RowParallelLinear, 4, 8, group=None, dtype="fp32"), TypeError, "torch.dtype", group=True
    ),
    row(bad(parallelize_module, MLP, {"0": "diagonal"}, None), ValueError, "plan['0']", group=True),
    row(bad(parallelize_module, plan={}, group=None, model=3), TypeError, "nn.Module", group=True),
    row(bad(hvd.allreduce, tensor=3), TypeError, "hvd.allreduce", group=True),
    row(bad(hvd.allreduce, T, average="x"), TypeError, "True or False", group=True),
    row(bad(hvd.allreduce, T, name=3), TypeError, "a non-empty str", group=True),
    row(bad(hvd.broadcast, T, root_rank="0"), TypeError, "str '0'", group=True),
    row(bad(hvd.allgather, tensor=[1]), TypeError, "torch.Tensor", group=True),
    row(bad(hvd.grouped_allreduce, [3]), TypeError, "tensors[0] | int 3", group=True),
    row(
        bad(hvd.DistributedOptimizer, SGD_OPT, backward_passes_per_step="2"),
        TypeError,
        "int",
        group=True,
    ),
    row(bad(hvd.join, device="x"), TypeError, "an int", group=True),
    row(bad(hvd.ProcessSet, ranks=3), TypeError, "a list of ints"),
    # ---- phalanx.spawn
    row(bad(phalanx.spawn, 3), TypeError, "spawn(fn=3) | callable"),
    row(bad(phalanx.spawn, print, nprocs="2"), TypeError, "nprocs='2' | int"),
    row(bad(phalanx.spawn, print, nprocs=10**6), ValueError, "nprocs=1000000 | PHALANX_MAX_NPROC"),
    row(bad(phalanx.spawn, print, args=[1]), TypeError, "args=[1] | tuple"),
    row(bad(phalanx.spawn, print, timeout=-1), ValueError, "timeout=-1"),
    # ---- the CLI
    cli("run --nproc-per-node 100000", "--nproc-per-node 100000 | PHALANX_MAX_NPROC_PER_NODE"),
    cli("run --nnodes 0", "--nnodes 0 | at least 1"),
    cli("run --nnodes x", "--nnodes 'x'"),
    cli("run --master-port 99999", "--master-port 99999 | 1..65535"),
    cli("run --master-port abc", "--master-port 'abc'"),
    cli("run --nproc-per-node 0", "--nproc-per-node 0"),
    cli("run --nproc-per-node abc", "--nproc-per-node 'abc'"),
    cli("run --max-restarts -1", "--max-restarts -1"),
    cli("run --nnodes 2 --node-rank 5", "--node-rank 5 | --nnodes 2"),
    cli("run --monitor-interval -1", "--monitor-interval -1"),
    cli("run --rdzv-backend foo", "--rdzv-backend 'foo'"),
    cli("plan --params -5", "--params | -5"),
    cli("plan --params 1e9 --optimizer rmsprop", "--optimizer | 'rmsprop'"),
    cli("plan --params 1e9 --precision bf17", "--precision | 'bf17' | 'bf16-true' | 'fp16-master'"),
    cli("bench nosuch", "'nosuch'"),
]


def _children() -> set[int]:
    """Processes whose parent is this one (alive or zombie), from /proc."""
    me, found = str(os.getpid()), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        if stat.rsplit(")", 1)[1].split()[1] == me:
            found.add(int(entry.name))
    return found


def _sockets() -> int:
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:
            continue
    return count


def _foreign_frames(exc: BaseException) -> list[str]:
    """Frames in torch or urllib of ``exc`` and of every exception it would print with it."""
    found: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame in traceback.extract_tb(current.__traceback__):
            path = Path(frame.filename).resolve()
            if any(path.is_relative_to(package) for package in FOREIGN):
                found.append(f"{frame.filename}:{frame.lineno} ({type(current).__name__})")
        chained = current.__cause__
        if chained is None and not current.__suppress_context__:
            chained = current.__context__
        current = chained
    return found


def _use_group(wanted: bool) -> None:
    if wanted and not phalanx.is_initialized():
        init("gloo", rank=0, world_size=1, timeout=30)
        hvd.init()
    elif not wanted and phalanx.is_initialized():
        hvd.shutdown()
        phalanx.destroy_process_group()


@pytest.fixture(scope="module", autouse=True)
def _leave_no_group() -> Iterator[None]:
    yield
    _use_group(False)


def _run_with_deadline(call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` in a thread; fail the test if it has not returned by the deadline."""
    outcome: list[BaseException | None] = [None]

    def target() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test below
            outcome[0] = exc

    runner = threading.Thread(target=target, name="bad-input-row", daemon=True)
    runner.start()
    runner.join(DEADLINE_S)
    assert not runner.is_alive(), f"the call hung: still running after {DEADLINE_S} s"
    return outcome[0]


API = [c for c in CASES if c.call is not None]
CLI = [c for c in CASES if c.cli]


@pytest.mark.parametrize("row", API, ids=[c.id for c in API])
def test_bad_call_raises_a_clear_error(row: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in LAUNCH_ENV + OTHER_ENV:
        monkeypatch.delenv(var, raising=False)
    for var, value in row.env.items():
        monkeypatch.setenv(var, value)
    _use_group(row.group)
    threads, sockets, children = set(threading.enumerate()), _sockets(), _children()
    assert row.call is not None
    exc = _run_with_deadline(row.call)
    assert exc is not None, "no exception raised"
    assert isinstance(exc, row.error), f"{type(exc).__name__} raised, not {row.error.__name__}"
    message = str(exc)
    for word in row.expected():
        assert word in message, f"{word!r} not in the message: {message}"
    assert not _foreign_frames(exc), f"raised inside torch or urllib: {_foreign_frames(exc)}"
    assert _children() == children and multiprocessing.active_children() == []
    started = {t for t in threading.enumerate() if t.name != "bad-input-row"} - threads
    assert not started, f"threads started: {started}"
    assert _sockets() <= sockets, "a socket was left open"
    assert phalanx.is_initialized() == row.group, "the process group changed"


CLI_RUNNER = """
import contextlib, io, json, sys, traceback
from phalanx import cli
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"code": code, "stderr": err.getvalue()})
print(json.dumps(results))
"""
"""Every CLI row through ``phalanx.cli.main`` in one subprocess: one import of torch, not 13."""


@dataclass(frozen=True)
class CliRun:
    results: dict[str, tuple[int, str]]
    """Row id -> exit code and stderr."""
    marker: Path
    """The file the script of ``phalanx run`` rows would create."""


def _cli_argv(row: Case, script: Path) -> list[str]:
    return [*row.cli, str(script)] if row.cli[0] == "run" else list(row.cli)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    tmp = tmp_path_factory.mktemp("cli")
    marker, script = tmp / "worker-started", tmp / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    argvs = [_cli_argv(row, script) for row in CLI]
    done = subprocess.run(
        [sys.executable, "-c", CLI_RUNNER, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=CLI_DEADLINE_S,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    results = {row.id: (r["code"], r["stderr"]) for row, r in zip(CLI, rows)}
    return CliRun(results, marker)


@pytest.mark.parametrize("row", CLI, ids=[c.id for c in CLI])
def test_bad_command_line_is_refused_before_any_worker(row: Case, cli_run: CliRun) -> None:
    code, stderr = cli_run.results[row.id]
    assert code != 0
    assert "Traceback" not in stderr, stderr
    for word in row.words:
        assert word in stderr, f"{word!r} not in stderr: {stderr}"
    assert not cli_run.marker.exists(), "a worker started"


def test_the_console_script_refuses_before_any_worker(tmp_path: Path) -> None:
    """One row through the real entry point, ``python -m phalanx``, with its own deadline."""
    marker, script = tmp_path / "worker-started", tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "run", "--nnodes", "0", str(script)],
        capture_output=True,
        text=True,
        timeout=CLI_DEADLINE_S,
        env=env,
    )
    assert done.returncode != 0 and "--nnodes 0" in done.stderr
    assert "Traceback" not in done.stderr and not marker.exists()


def test_connect_timeout_is_honoured() -> None:
    """``timeout=2`` with nobody listening gives up after 2 s (torch's client retries: 7-12 s)."""
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"127\.0\.0\.1:{port} within timeout=2 s"):
        init("gloo", f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout=2)
    assert 2.0 <= time.monotonic() - start < 3.0


def test_the_table_covers_every_case_of_the_issue() -> None:
    ids = {c.id for c in CASES}
    issue = {
        "Job('single', grad_accum='4')",
        "Job('single', grad_accum=2.5)",
        "Job('single', seed='x')",
        "DistributedDataParallel(mlp, bucket_cap_mb='25')",
        "init_process_group(rank=0, world_size=2, init_method='tcp://h:99999')",
        "init_process_group(rank=0, world_size=2, init_method='tcp://h:abc')",
        "init_process_group(world_size=2, init_method='tcp://h:1?rank=x')",
        "init_process_group('gloo', 'tcp://127.0.0.1:<free port>', rank=1, world_size=2, "
        "timeout=1)",
    }
    assert issue <= ids, issue - ids
    assert len(ids) == len(CASES), "two rows with one id"
    assert len(API) >= 170 and len(CLI) >= 13


def test_the_frame_check_sees_torch_and_urllib() -> None:
    for call in (lambda: nn.BatchNorm1d("4"), lambda: urlsplit("tcp://[::1")):
        try:
            call()
        except (TypeError, ValueError) as exc:
            assert _foreign_frames(exc)
        else:
            raise AssertionError("expected an error")


def test_numpy_integers_are_ints_and_bools_are_not() -> None:
    assert check_int("n", np.int64(3), min=1) == 3 and type(check_int("n", np.int32(3))) is int
    with pytest.raises(TypeError, match="got bool True"):
        check_int("n", True)
    with pytest.raises(TypeError, match=r"got bool np\.True_"):
        check_int("n", np.bool_(True))
    assert check_bool("flag", np.bool_(False)) is False
    assert check_float("x", np.float32(0.5), above=0) == 0.5
    assert check_timeout("timeout", 5).total_seconds() == 5
    job = Job("single", grad_accum=np.int64(2), seed=np.int32(7))
    try:
        assert (job.grad_accum, job.seed) == (2, 7) and type(job.seed) is int
    finally:
        job.close()
