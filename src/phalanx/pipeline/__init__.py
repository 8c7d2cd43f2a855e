"""phalanx.pipeline: pipeline parallelism across processes (GPipe, 1F1B, interleaved 1F1B, ZB-H1).

``Pipeline(layers, group, schedule=..., micro_batches=..., loss_fn=...)`` keeps this rank's
stage(s) of a layer list and trains them with ``step(inputs, targets)``. The schedules, the
simulator and the stage balancer are pure functions, usable without any process group.
"""

from __future__ import annotations

from phalanx.pipeline.balance import balance_stages, parameter_costs, time_costs
from phalanx.pipeline.runner import Pipeline
from phalanx.pipeline.schedules import (
    Action,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    schedule,
    zb_h1,
)
from phalanx.pipeline.simulate import DeadlockError, Simulation, simulate
from phalanx.pipeline.stage import split_layers

__all__ = [
    "Action",
    "DeadlockError",
    "Pipeline",
    "Simulation",
    "balance_stages",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "parameter_costs",
    "schedule",
    "simulate",
    "split_layers",
    "time_costs",
    "zb_h1",
]
