"""The training-job API: one small object for a whole distributed training job."""

from __future__ import annotations

from phalanx.train.job import Job
from phalanx.train.metrics import MetricsLogger
from phalanx.train.profiling import profile
from phalanx.train.progress import progress
from phalanx.train.straggler_rule import StragglerRule
from phalanx.train.strategies import (
    DDP,
    DP,
    PS,
    DiLoCo,
    Hogwild,
    LocalSGD,
    Mesh,
    Runner,
    Single,
    Strategy,
    StreamingDiLoCo,
    TorchDDP,
    TorchFSDP,
    TorchZero1,
    Zero,
    register_strategy,
    strategy_names,
)

__all__ = [
    "DDP",
    "DP",
    "PS",
    "DiLoCo",
    "Hogwild",
    "Job",
    "LocalSGD",
    "Mesh",
    "MetricsLogger",
    "Runner",
    "Single",
    "StragglerRule",
    "Strategy",
    "StreamingDiLoCo",
    "TorchDDP",
    "TorchFSDP",
    "TorchZero1",
    "Zero",
    "profile",
    "progress",
    "register_strategy",
    "strategy_names",
]
