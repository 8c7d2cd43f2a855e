"""When a :class:`phalanx.Job` steps the learning-rate scheduler: ``Job.setup(schedule=...)``.

- ``"step"`` (the default): after each optimizer step, as Accelerate does with a prepared
  scheduler and as a plain torch loop calling ``scheduler.step()`` after ``optimizer.step()``
  does. Parameter servers step it on the servers, after each of their optimizer steps.
- ``"epoch"``: once at the end of each epoch (when the loop body of ``job.epochs()`` returns),
  Lightning's default interval.
- ``"manual"``: never; the user calls ``scheduler.step(...)`` where they like, e.g.
  ``ReduceLROnPlateau``'s ``scheduler.step(val_loss)`` after evaluating.

The option belongs to ``setup``, beside the scheduler it describes, not to ``Job``: it means
nothing without a scheduler, and a job's constructor keeps only job-wide options.
``ReduceLROnPlateau`` needs a metric in its ``step``, so an automatic schedule refuses it.
"""

from __future__ import annotations

from torch.optim.lr_scheduler import ReduceLROnPlateau

from phalanx._check import check_choice
from phalanx.train.strategies.base import Runner, Scheduler

__all__ = ["SCHEDULES", "check_schedule"]

SCHEDULES = ("step", "epoch", "manual")


def check_schedule(schedule: object, scheduler: Scheduler | None, runner: Runner) -> str:
    """``schedule`` checked against the choices, the scheduler and the strategy.

    Raises:
        ValueError: an unknown schedule, an automatic one with ``ReduceLROnPlateau``, or one
            the strategy cannot honour (parameter servers step on the servers).
        TypeError: ``schedule`` is not a string.
    """
    chosen = check_choice("schedule", schedule, SCHEDULES, where="Job.setup")
    if isinstance(scheduler, ReduceLROnPlateau) and chosen != "manual":
        raise ValueError(
            f"Job.setup(schedule={chosen!r}) with a ReduceLROnPlateau scheduler: its step() "
            f"needs the metric it watches; pass schedule='manual' and call "
            f"scheduler.step(val_loss) yourself"
        )
    runner.check_schedule(chosen)
    return chosen
