"""The training-job API: one small object for a whole distributed training job."""

from __future__ import annotations

from phalanx.train.job import Job
from phalanx.train.metrics import MetricsLogger
from phalanx.train.profiling import profile
from phalanx.train.progress import progress
from phalanx.train.stragglers import StragglerRule
from phalanx.train.strategies import register_strategy, strategy_names

__all__ = [
    "Job",
    "MetricsLogger",
    "StragglerRule",
    "profile",
    "progress",
    "register_strategy",
    "strategy_names",
]
