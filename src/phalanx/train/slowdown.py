"""Make one participant slower by a factor: the straggler of the consistency experiments.

A straggler's step takes ``factor`` times as long as it would: after the step's own work the
slowed participant sleeps ``(factor - 1)`` times the time that work took. Sleeping frees the CPU,
so on a small machine the slowdown does not also slow the others. Which participant is slow:

- a fixed one (``who=k``): a machine that is always slower, the case where synchronous training
  waits every step and asynchronous training does not;
- ``who="random"``: each step one participant, drawn from a generator seeded identically on
  every rank, so all agree on who it is: transient slowness (a noisy neighbour, a GC pause),
  the case bounded staleness (SSP) is designed for (Ho et al. 2013, section 2).
"""

from __future__ import annotations

import random
import time

__all__ = ["Slowdown"]


class Slowdown:
    """Slows participant ``who`` (or a random one per step) of ``count`` by ``factor``.

    Args:
        factor: How many times longer the slow participant's step takes, ``>= 1``.
        who: The slow participant's index in ``[0, count)``, or ``"random"``.
        index: This participant's index.
        count: Number of participants.
        seed: Seeds the per-step draw of ``who="random"`` (the same on every rank).
    """

    def __init__(
        self, factor: float, who: int | str, *, index: int, count: int, seed: int = 0
    ) -> None:
        if factor < 1:
            raise ValueError(f"straggler factor must be >= 1, got {factor}")
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"index={index} must be in [0, count={count})")
        if who != "random" and not (isinstance(who, int) and 0 <= who < count):
            raise ValueError(
                f"straggler who={who!r} must be 'random' or a participant index in [0, {count})"
            )
        self.factor, self.who, self.index, self.count = factor, who, index, count
        self._rng = random.Random(seed)
        self._started = time.perf_counter()
        self.slept = 0.0
        """Seconds this participant slept so far."""

    def slow_at(self, step: int) -> int:
        """The slow participant at ``step`` (draws in step order; call once per step)."""
        if self.who == "random":
            return self._rng.randrange(self.count)
        return int(self.who)

    def begin(self) -> None:
        """Mark the start of this participant's step (default: when the last one ended)."""
        self._started = time.perf_counter()

    def end(self, step: int) -> float:
        """End the step: sleep if this participant is the slow one; returns the seconds slept."""
        worked = time.perf_counter() - self._started
        pause = (self.factor - 1) * worked if self.slow_at(step) == self.index else 0.0
        if pause > 0:
            time.sleep(pause)
            self.slept += pause
        self._started = time.perf_counter()  # the next step starts now unless begin() says
        return pause
