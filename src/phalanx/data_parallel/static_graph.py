"""``static_graph=True``: learn once how each parameter's gradient hook fires, then rely on it.

In the first iteration every hook is counted and nothing is reduced until backward ends (a
parameter used by a reentrant backward, as in activation checkpointing, fires more than once
and its gradient is complete only after the last firing). From then on a parameter is reduced
when it has fired as often as in that first iteration, parameters that never fired are staged
when the iteration starts, and the parameters found unused on every rank stay untouched with no
usage all-reduce, as in torch's static-graph mode.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["HookCounts"]


class HookCounts:
    """Per-parameter hook counts: observed in this iteration, expected from the first one."""

    def __init__(self, n: int) -> None:
        self.fired = [0] * n
        self.expected: list[int] | None = None
        self.globally_unused: set[int] = set()

    @property
    def learned(self) -> bool:
        """Whether the first iteration has completed."""
        return self.expected is not None

    def start_iteration(self) -> None:
        """Forget the counts of the last iteration."""
        self.fired = [0] * len(self.fired)

    def complete(self, j: int, name: str) -> bool:
        """Count a firing of parameter ``j``'s hook; True when its gradient is now complete."""
        self.fired[j] += 1
        if self.expected is None:
            return False  # first iteration: complete only when backward ends
        if self.fired[j] > self.expected[j]:
            raise RuntimeError(
                f"[rank {dist.get_rank()}] DistributedDataParallel(static_graph=True): parameter "
                f"{name!r} received {self.fired[j]} gradients in this backward pass but "
                f"{self.expected[j]} in the first one; the graph changed, so pass "
                f"static_graph=False (and find_unused_parameters=True if parameters go unused)"
            )
        return self.fired[j] == self.expected[j]

    def never_fire(self) -> list[int]:
        """Parameters that received no gradient in the first iteration."""
        assert self.expected is not None
        return [j for j, n in enumerate(self.expected) if n == 0]

    def learn(self, globally_unused: set[int]) -> None:
        """End the first iteration: remember the counts and the parameters unused everywhere."""
        self.expected = list(self.fired)
        self.globally_unused = set(globally_unused)

    def check_all_fired(self, ready: list[bool], names: list[str]) -> None:
        """Every parameter must have been reduced by the end of a later iteration."""
        missing = [j for j, r in enumerate(ready) if not r]
        if missing:
            assert self.expected is not None
            shown = ", ".join(
                f"{names[j]!r} ({self.fired[j]} of {self.expected[j]})" for j in missing[:10]
            )
            raise RuntimeError(
                f"[rank {dist.get_rank()}] DistributedDataParallel(static_graph=True): "
                f"{len(missing)} parameter(s) received fewer gradients than in the first "
                f"iteration: {shown}; the graph changed, so pass static_graph=False"
            )
