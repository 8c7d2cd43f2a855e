"""Observers of a job's loop: how a tool outside ``train/`` watches its phases and steps.

A tool registers a factory (:func:`register`). Every :class:`~phalanx.train.Job` calls each
factory once, when it is made, with a :class:`JobView`, and keeps the observer returned (None:
not wanted for this job). Every rank makes its job at the same point of the program, so a
factory may communicate (the timeline measures clock offsets there). The job then tells each
observer where its loop is, on the training thread:

- ``phase(name)`` at every phase mark of its clock (:mod:`.phases`; None: not timing),
- ``relabel(name)`` where the clock counts the open stretch as another phase,
- ``loss(value)`` at each ``backward`` (the loss given, before any division by ``grad_accum``),
- ``stepping(step)`` just before the optimizer steps (the step's gradients are final),
- ``stepped(step)`` after each optimizer step (``step``: the job's step count after it),
- ``saved(step)`` after each ``save()``,
- ``close()`` when the job closes.

Marks come several times a step: ``phase`` must cost no more than an append. ``train/`` never
imports a tool: the tools that ship with phalanx are named in :data:`PROVIDERS` and imported
(they register themselves) the first time a job starts; a user's own tool calls
:func:`register` before making the job.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from phalanx.comm.group import World

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn

    from phalanx.train.job_checkpoint import Checkpoints
    from phalanx.train.strategies.base import Runner, Strategy

__all__ = [
    "PROVIDERS",
    "JobObserver",
    "JobView",
    "ObservedJob",
    "register",
    "start",
    "unregister",
]

PROVIDERS = ("phalanx.diagnostics.job_timeline", "phalanx.diagnostics.verify.probe")
"""Modules that register phalanx's own observers when imported (the timeline recorder, the
probe of ``phalanx verify``)."""


class ObservedJob(Protocol):
    """What a tool may read of the job it observes (a ``phalanx.Job``)."""

    @property
    def world(self) -> World: ...

    strategy: Strategy
    runner: Runner
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    checkpoints: Checkpoints

    def save(self, *, async_: bool = True, **extra: object) -> Path: ...


@dataclass(frozen=True)
class JobView:
    """What a factory learns about the job it may observe."""

    world: World
    """This process's place in the job."""
    lockstep: bool
    """Every rank steps and saves together (not a parameter server, not live recovery): an
    observer may run a collective in ``stepped`` and ``saved``."""
    live: bool
    """Live recovery: members come and go (a replacement makes its job late), so an observer
    must not communicate at all, not even when it is made."""
    timeline_dir: str | None
    """``Job(timeline_dir=...)`` (None: not given; ``PHALANX_TIMELINE_DIR`` may still ask)."""
    job: ObservedJob | None = None
    """The job itself, for a tool that reads its state (``phalanx verify``'s probe reads the
    model, optimizer and gradients through ``job.runner``); None where a test makes a view."""


class JobObserver(Protocol):
    """What a job tells an observer (see the module's docstring)."""

    def phase(self, name: str | None) -> None: ...

    def relabel(self, name: str) -> None: ...

    def loss(self, value: torch.Tensor) -> None: ...

    def stepping(self, step: int) -> None: ...

    def stepped(self, step: int) -> None: ...

    def saved(self, step: int) -> None: ...

    def close(self) -> None: ...


Factory = Callable[[JobView], "JobObserver | None"]
_factories: list[Factory] = []
_providers_loaded = [False]


def register(factory: Factory) -> None:
    """Call ``factory(view)`` for every job made from now on (once; a second call is a no-op)."""
    if factory not in _factories:
        _factories.append(factory)


def unregister(factory: Factory) -> None:
    """Undo :func:`register` (absent: nothing happens)."""
    if factory in _factories:
        _factories.remove(factory)


def start(view: JobView) -> list[JobObserver]:
    """The observers every registered factory wants for the job ``view`` describes."""
    if not _providers_loaded[0]:
        _providers_loaded[0] = True
        for name in PROVIDERS:
            importlib.import_module(name)
    made = (factory(view) for factory in list(_factories))
    return [observer for observer in made if observer is not None]
