"""Zero-bubble schedule ZB-H1 (Qi et al., 2024, "Zero Bubble Pipeline Parallelism").

Backward splits into two passes: ``I``, the gradient of the stage's *input*, which the
previous stage waits for, and ``W``, the gradient of its *weights*, which nobody waits for. A
1F1B rank sits idle while the gradient it needs travels back up the pipeline; ZB-H1 fills that
time with deferred ``W`` passes.

Rank ``r`` of ``p`` runs 1F1B's ``p - 1 - r`` warm-up forwards, then, for each micro-batch
``i`` in turn, the next forward (while any is left), the ``I`` of ``i`` and the ``W`` of
``i - r``: the ``W`` passes lag ``r`` micro-batches behind, so that the ranks nearer the end,
whose gradients the others wait for, put their ``W`` passes where they would have waited. The
``W`` passes still owed close the list. Every rank then holds at most ``p`` micro-batches'
activations (from a forward until its ``W``), 1F1B's peak (its first rank's). With ``F``,
``I`` and ``W`` of equal time the bubble falls from 1F1B's ``(p-1)(F+I+W)`` to
``(p-1)(F+I-W)``: a third of it; with a ``W`` that costs nothing the schedule is 1F1B's
(``tests/unit/test_pipeline_schedules.py`` checks both with :func:`phalanx.pipeline.simulate`).
torch's ``ScheduleInterleavedZeroBubble`` runs the same order on one stage per rank.
"""

from __future__ import annotations

from phalanx._check import check_int
from phalanx.pipeline.action import Action

__all__ = ["zb_h1"]


def zb_h1(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Stage ``stage``'s ZB-H1 action list: ``F``, ``I`` and ``W`` of each micro-batch."""
    check_int("num_stages", num_stages, min=1)
    check_int("num_microbatches", num_microbatches, min=1)
    check_int("stage", stage, min=0, max=num_stages - 1)
    m, lag = num_microbatches, stage
    warmup = min(num_stages - 1 - stage, m)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(m):
        if warmup + i < m:
            actions.append(Action("F", warmup + i))
        actions.append(Action("I", i))
        if i >= lag:
            actions.append(Action("W", i - lag))
    return actions + [Action("W", i) for i in range(max(0, m - lag), m)]
