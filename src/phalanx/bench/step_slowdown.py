"""How much a background checkpoint write slows the training steps that run beside it.

A :class:`Trainer` is a stand-in training loop on the rank: an MLP (four 1024 x 1024 layers,
batch 256, SGD) stepped on one intra-op thread, so that on a small machine the other cores are
left to the writer as a GPU host leaves its spare cores. It times its steps with no write in
flight (the baseline) and while one is (until the writer says it is done); the slowdown is the
ratio of the two medians less one: what DCP moved its writer into a process of its own to
reduce (its writer thread shares the training process's GIL).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["Trainer", "slowdown"]


class Trainer:
    """A training step to time: forward, backward and SGD on a fixed batch."""

    def __init__(self, width: int = 1024, depth: int = 4, batch: int = 256) -> None:
        generator = torch.Generator().manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.model = nn.Sequential(*layers)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, width, generator=generator)

    def step(self) -> float:
        """Seconds of one step, on one intra-op thread (restored after)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            start = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            self.model(self.x).square().mean().backward()
            self.optimizer.step()
            return time.perf_counter() - start
        finally:
            torch.set_num_threads(threads)

    def steps(self, count: int) -> list[float]:
        """``count`` step times."""
        return [self.step() for _ in range(count)]

    def steps_while(self, running: Callable[[], bool]) -> list[float]:
        """Step times for as long as ``running()`` says the write goes on (at least one)."""
        times = [self.step()]
        while running():
            times.append(self.step())
        return times


def slowdown(baseline: list[float], during: list[float]) -> float:
    """``median(during) / median(baseline) - 1``: 0.05 is steps 5% slower during the write."""
    return statistics.median(during) / statistics.median(baseline) - 1
