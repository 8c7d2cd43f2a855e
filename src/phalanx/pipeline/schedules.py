"""Pipeline schedules as pure action lists: GPipe, 1F1B, interleaved 1F1B and ZB-H1.

A schedule says, for one rank of a ``p``-rank pipeline and a batch of ``m`` micro-batches, in
which order that rank runs forward (``F``) and backward (``B``) passes of which micro-batch on
which of its model chunks. No process group is involved; the runner executes the list and
:mod:`phalanx.pipeline.simulate` replays it with stage timings.

- **GPipe** (Huang et al., 2019): all ``m`` forwards, then all ``m`` backwards. Bubble
  ``(p-1)/(m+p-1)``; every micro-batch's activations are alive at once (``m`` in flight).
- **1F1B** / PipeDream-Flush (Narayanan et al., 2021): ``p-r-1`` warm-up forwards, then one
  forward / one backward alternately, then the remaining backwards. Same bubble as GPipe, but
  at most ``p-r`` micro-batches in flight on rank ``r``.
- **Interleaved 1F1B** (Megatron-LM, Narayanan et al., 2021): each rank holds ``v`` chunks;
  virtual stage ``s = chunk * p + rank``, so activations go rank r -> r+1 and from rank p-1 back
  to rank 0 for the next chunk. Bubble ``(p-1)/(v*m+p-1)`` of the 1F1B one.
- **ZB-H1** (Qi et al., 2024): backward split into ``I`` (the input's gradient) and ``W`` (the
  weights'), ``W`` deferred into what would be bubbles; 1F1B's memory, a third of its bubble
  when the three passes take equal time (:mod:`phalanx.pipeline.zero_bubble`).
"""

from __future__ import annotations

from phalanx._check import check_choice, check_int
from phalanx.pipeline.action import Action
from phalanx.pipeline.zero_bubble import zb_h1

__all__ = [
    "SCHEDULES",
    "Action",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_warmup",
    "one_f_one_b",
    "schedule",
    "zb_h1",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1")


def _check_rank(num_ranks: int, num_microbatches: int, rank: int) -> None:
    check_int("num_stages", num_ranks, min=1)
    check_int("num_microbatches", num_microbatches, min=1)
    check_int("stage", rank, min=0, max=num_ranks - 1)


def gpipe(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """GPipe: every forward, then every backward (in micro-batch order).

    Args:
        num_stages: Pipeline depth ``p``.
        num_microbatches: Micro-batches per step ``m``.
        stage: This rank's stage, ``0 <= stage < p``.
    """
    _check_rank(num_stages, num_microbatches, stage)
    m = num_microbatches
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """1F1B (PipeDream-Flush): warm-up forwards, alternate F/B, drain backwards.

    Stage ``r`` runs ``min(p - r - 1, m)`` warm-up forwards: exactly enough that its first
    backward arrives from stage ``r+1`` as it finishes them, so at most ``min(p - r, m)``
    micro-batches are in flight (Narayanan et al., 2021, Fig. 4).
    """
    _check_rank(num_stages, num_microbatches, stage)
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    return actions + [Action("B", i) for i in range(m - warmup, m)]


def _groups(num_ranks: int, num_microbatches: int) -> list[range]:
    """Micro-batch groups that sweep through all chunks before the next group starts.

    Megatron uses groups of exactly ``p`` (so needs ``m % p == 0``). A group must hold at
    least ``p`` micro-batches, or rank 0 waits for its own first micro-batch to come back around
    the ring; so use ``max(1, m // p)`` groups of near-equal size (larger first), each in
    ``[p, 2p)`` when ``m >= p`` — any ``m`` works (torch's "flex" variant needs them equal).
    """
    rounds = max(1, num_microbatches // num_ranks)
    base, extra = divmod(num_microbatches, rounds)
    groups, start = [], 0
    for g in range(rounds):
        size = base + (1 if g < extra else 0)
        groups.append(range(start, start + size))
        start += size
    return groups


def interleaved_warmup(num_ranks: int, num_microbatches: int, rank: int, chunks: int) -> int:
    """Forwards rank ``rank`` runs before its first backward in interleaved 1F1B.

    Megatron-LM's ``(v - 1) * g + 2 * (p - rank - 1)``, capped at ``v * m``, with ``g`` the
    largest micro-batch group (``p`` when ``m % p == 0``): the last stage must have run chunk
    ``v-1`` of the group's first micro-batch before its first backward, and each hop towards
    rank 0 adds a forward and a backward of delay. At most ``warmup + 1`` micro-batch chunks
    are then in flight.
    """
    g = max(len(r) for r in _groups(num_ranks, num_microbatches))
    warm = (chunks - 1) * g + 2 * (num_ranks - rank - 1)
    return min(warm, chunks * num_microbatches)


def _interleaved_order(num_ranks: int, num_microbatches: int, chunks: int) -> list[Action]:
    """Forward order of (micro-batch, chunk): per group, chunk by chunk (depth first)."""
    return [
        Action("F", mb, c)
        for group in _groups(num_ranks, num_microbatches)
        for c in range(chunks)
        for mb in group
    ]


def _backward_order(num_ranks: int, num_microbatches: int, chunks: int) -> list[Action]:
    """Backward order: per group, the last chunk first (the reverse of the forward sweep)."""
    return [
        Action("B", mb, c)
        for group in _groups(num_ranks, num_microbatches)
        for c in reversed(range(chunks))
        for mb in group
    ]


def interleaved_1f1b(num_ranks: int, num_microbatches: int, rank: int, chunks: int) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM) over ``chunks`` model chunks per rank.

    Forwards follow :func:`_interleaved_order`; backwards the same order with chunks reversed
    (the last chunk's backward comes first). ``chunks == 1`` is plain :func:`one_f_one_b`.
    Valid for every ``m >= 1`` and ``p >= 1``: groups of unequal size are allowed because the
    warm-up uses the largest one (see :func:`interleaved_warmup`).
    """
    _check_rank(num_ranks, num_microbatches, rank)
    check_int("chunks", chunks, min=1)
    if chunks == 1:
        return one_f_one_b(num_ranks, num_microbatches, rank)
    fwd = _interleaved_order(num_ranks, num_microbatches, chunks)
    bwd = _backward_order(num_ranks, num_microbatches, chunks)
    warmup = interleaved_warmup(num_ranks, num_microbatches, rank, chunks)
    actions = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        actions += [fwd[warmup + i], bwd[i]]
    return actions + bwd[len(fwd) - warmup :]


def schedule(
    name: str, num_ranks: int, num_microbatches: int, rank: int, chunks: int = 1
) -> list[Action]:
    """The action list of schedule ``name`` (``"gpipe"``, ``"1f1b"``, ``"interleaved"``,
    ``"zbh1"``).

    Raises:
        ValueError: unknown ``name``, or ``chunks > 1`` with a schedule other than
            ``"interleaved"``.
    """
    check_choice("schedule", name, SCHEDULES, where="schedule")
    check_int("chunks", chunks, min=1, where="schedule")
    if name == "interleaved":
        return interleaved_1f1b(num_ranks, num_microbatches, rank, chunks)
    if chunks != 1:
        raise ValueError(
            f"chunks={chunks} needs schedule='interleaved', got schedule={name!r} "
            "(GPipe, 1F1B and ZB-H1 run one model chunk per rank)"
        )
    _check_rank(num_ranks, num_microbatches, rank)
    fn = {"gpipe": gpipe, "1f1b": one_f_one_b, "zbh1": zb_h1}[name]
    return fn(num_ranks, num_microbatches, rank)
