"""Replay per-rank action lists with stage timings: makespan, bubbles, activation memory.

Pure: no process group. Each rank runs its list in order; an action starts when the rank is
free and its inputs exist (the semantics of the runner, whose sends never block):

- ``F`` of (micro-batch, virtual stage ``s``) needs ``F`` of (micro-batch, ``s - 1``);
- ``B`` of (micro-batch, ``s``) needs ``F`` of (micro-batch, ``s``) and the input gradient of
  (micro-batch, ``s + 1``), which its ``B`` or its ``I`` computes;
- ``I`` (a backward's input half) needs what ``B`` needs; ``W`` (its weight half) needs the
  ``I`` of the same micro-batch and stage.

Virtual stage ``s`` lives on rank ``s % p`` as chunk ``s // p`` (chunks loop around the ranks,
as in Megatron-LM's interleaved schedule). A dependency that crosses ranks adds ``latency``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.pipeline.action import Action

__all__ = ["DeadlockError", "Simulation", "simulate"]


class DeadlockError(ValueError):
    """A schedule whose dependencies can never be met."""


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` measured."""

    makespan: float
    """Time from the first action's start to the last action's end."""
    busy: list[float]
    """Per rank: time spent computing."""
    idle: list[float]
    """Per rank: ``makespan - busy``, the pipeline bubble on that rank."""
    max_in_flight: list[int]
    """Per rank: most micro-batch chunks whose forward ran and whose backward (its ``W``,
    when split) has not."""
    timeline: list[list[tuple[Action, float, float]]]
    """Per rank: ``(action, start, end)`` in execution order."""

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time, ``sum(idle) / (p * makespan)``."""
        total = len(self.idle) * self.makespan
        return sum(self.idle) / total if total else 0.0


def _per_stage(name: str, value: float | Sequence[float], stages: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * stages
    times = [float(v) for v in value]
    if len(times) != stages:
        raise ValueError(f"{name} has {len(times)} entries for {stages} virtual stages")
    return times


class _Replay:
    """Event bookkeeping of one simulation: finish times of every (kind, micro-batch, stage)."""

    def __init__(self, ranks: int, stages: int, latency: float) -> None:
        self.p, self.stages, self.latency = ranks, stages, latency
        self.done: dict[tuple[str, int, int], float] = {}

    def ready_at(self, a: Action, rank: int) -> float | None:
        """When ``a``'s inputs are available on ``rank``; None if some are not computed yet."""
        s = a.chunk * self.p + rank
        deps = []
        if a.kind == "F" and s > 0:
            deps.append(("F", a.microbatch, s - 1))
        if a.kind in "BI":
            deps.append(("F", a.microbatch, s))
            if s < self.stages - 1:
                deps.append(("G", a.microbatch, s + 1))  # the input gradient: B's or I's
        if a.kind == "W":
            deps.append(("I", a.microbatch, s))
        t = 0.0
        for dep in deps:
            if dep not in self.done:
                return None
            hop = self.latency if dep[2] % self.p != rank else 0.0
            t = max(t, self.done[dep] + hop)
        return t

    def finish(self, a: Action, rank: int, end: float) -> None:
        key = (a.kind, a.microbatch, a.chunk * self.p + rank)
        if key in self.done:
            raise ValueError(f"rank {rank} runs {a!r} twice")
        self.done[key] = end
        if a.kind in "BI":
            self.done[("G", *key[1:])] = end


def simulate(
    actions: Sequence[Sequence[Action]],
    forward_time: float | Sequence[float] = 1.0,
    backward_time: float | Sequence[float] = 2.0,
    latency: float = 0.0,
    weight_time: float | Sequence[float] | None = None,
) -> Simulation:
    """Execute every rank's action list with the given stage times.

    Args:
        actions: ``actions[r]`` is rank ``r``'s list (e.g. from :func:`schedule`).
        forward_time: Forward time of one micro-batch, for every virtual stage or a list with
            one entry per virtual stage (``p * chunks`` of them, in stage order).
        backward_time: Backward time, likewise.
        latency: Added to every dependency that crosses ranks (a P2P transfer).
        weight_time: Of a backward split in two (``I`` then ``W``), the ``W`` part; ``I``
            takes the rest of ``backward_time``. Default: half of it.

    Raises:
        DeadlockError: some rank's next action waits on something that never happens; names
            each stuck rank and its action.
    """
    p = len(actions)
    chunks = 1 + max((a.chunk for acts in actions for a in acts), default=0)
    t_f = _per_stage("forward_time", forward_time, p * chunks)
    t_b = _per_stage("backward_time", backward_time, p * chunks)
    half = [b / 2 for b in t_b]
    t_w = half if weight_time is None else _per_stage("weight_time", weight_time, p * chunks)
    times = {"F": t_f, "B": t_b, "W": t_w, "I": [b - w for b, w in zip(t_b, t_w, strict=True)]}
    replay = _Replay(p, p * chunks, latency)
    clock, pos = [0.0] * p, [0] * p
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                ready = replay.ready_at(a, r)
                if ready is None:
                    break
                stage = a.chunk * p + r
                start = max(clock[r], ready)
                clock[r] = start + times[a.kind][stage]
                replay.finish(a, r, clock[r])
                timeline[r].append((a, start, clock[r]))
                pos[r] += 1
                progress = True
    _raise_if_stuck(actions, pos)
    return _summarize(timeline)


def _raise_if_stuck(actions: Sequence[Sequence[Action]], pos: list[int]) -> None:
    stuck = [
        f"rank {r} at {acts[pos[r]]!r}" for r, acts in enumerate(actions) if pos[r] < len(acts)
    ]
    if stuck:
        raise DeadlockError(
            f"schedule deadlocks: {'; '.join(stuck)} (each waits on an action that can only "
            "run after it)"
        )


def _summarize(timeline: list[list[tuple[Action, float, float]]]) -> Simulation:
    makespan = max((end for acts in timeline for _, _, end in acts), default=0.0)
    busy = [sum(end - start for _, start, end in acts) for acts in timeline]
    in_flight = []
    for acts in timeline:
        live = peak = 0
        for a, _, _ in acts:
            live += {"F": 1, "B": -1, "I": 0, "W": -1}[a.kind]
            peak = max(peak, live)
        in_flight.append(peak)
    return Simulation(makespan, busy, [makespan - b for b in busy], in_flight, timeline)
