"""Measure every rank's clock against rank 0's: a few point-to-point ping-pongs per rank.

Rank 0 answers each other rank in turn, ``rounds`` times; each rank keeps the exchange with the
shortest round trip (:mod:`.clock_math`). The messages are two float64 on the group's device,
sent with ``torch.distributed`` directly (not phalanx's tracked calls: the timeline must not
record its own measurement), with a tag of their own. It is a collective of the default group:
every rank calls :func:`measure` at the same point of the program. Cost on gloo, 4 ranks on one
host: 3 x ``rounds`` round trips of 0.1 to 0.5 ms each (16 rounds: 5 to 25 ms), as rank 0
answers one rank after another.

Where the backend is NCCL the buffers are on the rank's GPU, and a point-to-point channel
between rank 0 and each rank is made at the first measurement (NCCL makes one per pair); the
device-to-host copy that reads the answer lengthens the round trip, and with it the error bound,
never the offset's bias.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from phalanx.diagnostics.clock_math import ClockSample, best, ntp_sample

__all__ = ["SYNC_TAG", "measure"]

SYNC_TAG = 0x7C10
"""The tag of the measurement's messages (apart from any the job sends)."""


def measure(
    rounds: int = 16,
    device: torch.device | str = "cpu",
    clock: Callable[[], float] | None = None,
) -> ClockSample:
    """This rank's clock against rank 0's (rank 0 and a single process: offset 0, rtt 0).

    Args:
        rounds: Exchanges per rank; the one with the shortest round trip is kept.
        device: Where the message buffers live (the backend's device).
        clock: The clock measured (default ``time.time``, looked up at each call: the clock
            the timeline and the flight records stamp events with).
    """
    clock = clock or (lambda: time.time())
    if rounds < 1:
        raise ValueError(f"clock sync: rounds must be >= 1, got {rounds}")
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return ClockSample(at=clock(), offset=0.0, rtt=0.0)
    buf = torch.zeros(2, dtype=torch.float64, device=device)
    if dist.get_rank() == 0:
        _serve(buf, rounds, clock)
        return ClockSample(at=clock(), offset=0.0, rtt=0.0)
    return best(_ask(buf, clock) for _ in range(rounds))


def _serve(buf: torch.Tensor, rounds: int, clock: Callable[[], float]) -> None:
    """Rank 0: answer each other rank ``rounds`` times with (receive time, answer time)."""
    for peer in range(1, dist.get_world_size()):
        for _ in range(rounds):
            dist.recv(buf, peer, tag=SYNC_TAG)
            t2 = clock()
            buf.copy_(torch.tensor([t2, clock()], dtype=torch.float64))
            dist.send(buf, peer, tag=SYNC_TAG)


def _ask(buf: torch.Tensor, clock: Callable[[], float]) -> ClockSample:
    """One exchange with rank 0."""
    t1 = clock()
    dist.send(buf, 0, tag=SYNC_TAG)
    dist.recv(buf, 0, tag=SYNC_TAG)
    t2, t3 = buf.tolist()  # on a GPU this waits for the copy: inside the round trip
    return ntp_sample(t1, t2, t3, clock())
