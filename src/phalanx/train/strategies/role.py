"""What a rank does in a job: train in step with every other rank, or serve, or train alone.

A :class:`Runner` says *how* the model trains; its :class:`Role` says *whether and with whom*
this rank trains: which ranks compute steps and log together, who draws the progress bar, when
the loop stops. Every strategy but the parameter servers keeps the default (every rank trains,
in step); ``PS`` gives servers and workers their own roles (``strategies/ps.py``). Kept apart
so that the job asks the role, never the runner's class.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch.distributed as dist

from phalanx.comm.group import World

if TYPE_CHECKING:  # annotations only: a role of every job needs no parameter server
    from phalanx.parameter_server import ServerReport

__all__ = ["Role"]


class Role:
    """Every rank trains, in step with the others (the default)."""

    is_server = False
    """True on a rank that serves instead of training (a parameter server)."""
    report: ServerReport | None = None
    """What this rank served, once it has (parameter servers); else None."""

    def serving(self) -> bool:
        """Serve (once) where this rank is a server; True when it has no batches to train on."""
        return False

    def before_batch(self) -> bool:
        """Called before each batch; False stops the loop (a parameter server said so)."""
        return True

    def finished(self) -> bool:
        """True once this rank is told to stop training (a parameter server's budget)."""
        return False

    def finish(self) -> None:
        """The loop is over: leave the role (idempotent)."""

    def participants(self, world: World) -> tuple[int, int] | None:
        """(how many ranks compute steps, this rank's index among them), or None if it does not."""
        return world.world_size, world.rank

    def metrics_group(self) -> dist.ProcessGroup | None:
        """The group metrics average over (None: every rank). Collective: call once, in turn."""
        return None

    def logs_in_step(self) -> bool:
        """True when the ranks train in step, so metrics may be averaged over them."""
        return True

    def progress_rank(self) -> int:
        """The rank that draws the progress bar."""
        return 0

    def peer_sets(self) -> Iterable[list[int]] | None:
        """Ranks doing the same work, for the straggler monitor: None, all; [] compares none."""
        return None
