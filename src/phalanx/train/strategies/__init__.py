"""Strategies: how a :class:`phalanx.Job` trains one model on many ranks.

Options are frozen dataclasses (:class:`Strategy` subclasses), checked when built; each one
starts a :class:`Runner` per job, the protocol the job calls. Names such as ``"zero2"`` are
presets (:func:`strategy_names`); :func:`register_strategy` adds a user's own class.
"""

from __future__ import annotations

from phalanx.train.strategies.base import JobOptions, Prepared, Runner, Strategy
from phalanx.train.strategies.ddp import DDP
from phalanx.train.strategies.hogwild import Hogwild
from phalanx.train.strategies.local_sgd import DiLoCo, LocalSGD
from phalanx.train.strategies.mesh import Mesh
from phalanx.train.strategies.ps import PS
from phalanx.train.strategies.registry import register_strategy, resolve, strategy_names
from phalanx.train.strategies.single import DP, Single
from phalanx.train.strategies.streaming_diloco import StreamingDiLoCo
from phalanx.train.strategies.torch_ddp import TorchDDP
from phalanx.train.strategies.torch_fsdp import TorchFSDP
from phalanx.train.strategies.torch_zero import TorchZero1
from phalanx.train.strategies.zero import Zero

__all__ = [
    "DDP",
    "DP",
    "PS",
    "DiLoCo",
    "Hogwild",
    "JobOptions",
    "LocalSGD",
    "Mesh",
    "Prepared",
    "Runner",
    "Single",
    "Strategy",
    "StreamingDiLoCo",
    "TorchDDP",
    "TorchFSDP",
    "TorchZero1",
    "Zero",
    "register_strategy",
    "resolve",
    "strategy_names",
]
