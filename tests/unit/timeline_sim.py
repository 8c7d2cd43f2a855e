"""Synthetic rank logs for the timeline's unit tests: a data-parallel or a two-stage pipeline
job simulated in plain arithmetic, with one rank's phase made slower where asked."""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.diagnostics.clock_math import ClockSample
from phalanx.diagnostics.events import Op
from phalanx.diagnostics.rank_log import RankLog

PHASES = ("data", "forward", "backward", "optimizer")
BASE_S = {"data": 0.002, "forward": 0.003, "backward": 0.004, "optimizer": 0.001}
TRANSFER_S = 0.0002


@dataclass
class Sim:
    """Builds the logs; every time is true time, written down as ``true + skew[rank]``."""

    world_size: int
    skew: dict[int, float] = field(default_factory=dict)
    logs: dict[int, RankLog] = field(init=False)

    def __post_init__(self) -> None:
        self.logs = {r: RankLog(r, self.world_size, host="sim") for r in range(self.world_size)}
        for r, log in self.logs.items():
            off = self.skew.get(r, 0.0)
            log.syncs = [] if r == 0 else [ClockSample(at=off, offset=-off, rtt=1e-5)]

    def local(self, rank: int, t: float) -> float:
        return t + self.skew.get(rank, 0.0)

    def mark(self, rank: int, t: float, phase: str | None) -> None:
        self.logs[rank].marks.append((self.local(rank, t), phase))

    def step(self, rank: int, t: float, n: int) -> None:
        self.logs[rank].steps.append((self.local(rank, t), n))

    def wait(self, rank: int, start: float, end: float) -> None:
        self.logs[rank].waits.append((self.local(rank, start), self.local(rank, end)))

    def op(self, rank: int, op: Op) -> None:
        op.start = self.local(rank, op.start)
        op.end = None if op.end is None else self.local(rank, op.end)
        self.logs[rank].ops.append(op)

    def close(self, rank: int, t: float) -> None:
        self.logs[rank].closed = self.local(rank, t)


def ddp(
    world_size: int,
    steps: int,
    delays: dict[int, tuple[int, str, float]],
    skew: dict[int, float] | None = None,
    buckets: int = 1,
) -> list[RankLog]:
    """``steps`` data-parallel steps; ``delays[step] = (rank, phase, seconds)``. Gradients
    go in ``buckets`` asynchronous all-reduces launched during backward, waited at its end."""
    sim = Sim(world_size, skew or {})
    now = dict.fromkeys(range(world_size), 0.0)
    seq = 0
    for n in range(1, steps + 1):
        extra = delays.get(n)

        def dur(rank: int, phase: str, extra: tuple[int, str, float] | None = extra) -> float:
            slow = extra is not None and extra[0] == rank and extra[1] == phase
            return BASE_S[phase] + (extra[2] if slow and extra else 0.0)

        launches: dict[int, list[float]] = {}
        for r in range(world_size):
            t = now[r]
            sim.mark(r, t, "data")
            t += dur(r, "data")
            sim.mark(r, t, "forward")
            t += dur(r, "forward")
            sim.mark(r, t, "backward")
            t += dur(r, "backward") - BASE_S["backward"]  # a slow backward is slow from its start
            span = BASE_S["backward"]
            launches[r] = [t + span * (k + 1) / (buckets + 1) for k in range(buckets)]
            now[r] = t + span  # the end of backward's compute: it waits from here
        done = [max(launches[r][k] for r in launches) + TRANSFER_S for k in range(buckets)]
        for k in range(buckets):
            seq += 1
            for r in range(world_size):
                sim.op(
                    r,
                    Op(
                        "0", seq, "all_reduce", "[8] float32", "SUM", "sim", launches[r][k], done[k]
                    ),
                )
        for r in range(world_size):
            release = max(now[r], done[-1])
            if release > now[r]:
                sim.wait(r, now[r], release)
            sim.mark(r, release, "optimizer")
            t = release + dur(r, "optimizer")
            sim.mark(r, t, None)
            sim.step(r, t, n)
            now[r] = t
    for r in range(world_size):
        sim.close(r, now[r])
    return list(sim.logs.values())


def pipeline(steps: int, delays: dict[int, tuple[int, str, float]]) -> list[RankLog]:
    """Two stages: rank 0's forward sends activations to rank 1 (which waits in its forward),
    rank 1's backward sends gradients back (rank 0 waits in its backward)."""
    sim = Sim(2)
    now = {0: 0.0, 1: 0.0}
    for n in range(1, steps + 1):

        def dur(rank: int, phase: str, d: tuple[int, str, float] | None = delays.get(n)) -> float:
            return BASE_S[phase] + (d[2] if d and d[0] == rank and d[1] == phase else 0.0)

        sim.mark(0, now[0], "forward")
        sent = now[0] + dur(0, "forward")
        sim.op(0, Op("p2p", n * 2, "send", "[4]", "", "sim", sent, sent + TRANSFER_S, peer=1))
        sim.mark(0, sent + TRANSFER_S, "backward")
        sim.mark(1, now[1], "forward")
        got = sent + TRANSFER_S
        sim.op(1, Op("p2p", n * 2, "recv", "[4]", "", "sim", now[1], got, peer=0))
        sim.wait(1, now[1], got)
        t1 = got + dur(1, "forward")
        sim.mark(1, t1, "backward")
        back = t1 + dur(1, "backward")
        sim.op(1, Op("p2p", n * 2 + 1, "send", "[4]", "", "sim", back, back + TRANSFER_S, peer=0))
        start0 = sent + TRANSFER_S
        arrive = back + TRANSFER_S
        sim.op(0, Op("p2p", n * 2 + 1, "recv", "[4]", "", "sim", start0, arrive, peer=1))
        sim.wait(0, start0, arrive)
        t0 = arrive + dur(0, "backward")
        for r, t in ((0, t0), (1, back + TRANSFER_S)):
            sim.mark(r, t, "optimizer")
            end = t + dur(r, "optimizer")
            sim.mark(r, end, None)
            sim.step(r, end, n)
            now[r] = end
    for r in (0, 1):
        sim.close(r, now[r])
    return list(sim.logs.values())
