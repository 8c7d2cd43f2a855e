"""Model parallelism in one process: a chain of layers split over several devices (seed 001 §4)."""

from __future__ import annotations

from phalanx.model_parallel.split import SplitModule, split_across_devices

__all__ = ["SplitModule", "split_across_devices"]
