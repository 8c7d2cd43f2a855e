"""Data loading for distributed training: sharding a dataset over ranks (for training, and
exactly once each for evaluation), and an elastic order that keeps every sample exactly once per
epoch while ranks leave and join (with a ledger that proves it)."""

from __future__ import annotations

from phalanx.data.elastic_plan import StepPlan
from phalanx.data.elastic_sampler import CollateOrNone, ElasticSampler
from phalanx.data.eval import EvalSampler
from phalanx.data.ledger import EpochAudit, SampleLedger
from phalanx.data.sampler import DistributedSampler

__all__ = [
    "CollateOrNone",
    "DistributedSampler",
    "ElasticSampler",
    "EpochAudit",
    "EvalSampler",
    "SampleLedger",
    "StepPlan",
]
