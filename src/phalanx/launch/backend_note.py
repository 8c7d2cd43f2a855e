"""What backend the workers will get, for the launcher's start-up line of each generation.

A worker that leaves the backend to phalanx (``phalanx.init_process_group()``, ``phalanx.Job``)
gets NCCL on a GPU, the shared-memory backend when every CPU rank runs on this machine or when
every machine runs 2 or more (the hierarchical group: shared memory inside each machine, gloo
between them), and gloo otherwise (:func:`phalanx.comm.backends.auto_backend`). The launcher
says which, and how to opt out, so a user never wonders what carried the job. An elastic job
whose generation changes shape can change that default (a node with a single rank joins: shm
to gloo; it leaves: back): :class:`BackendNotes` says so in the line of the generation where it
changes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from phalanx.comm.backends import auto_backend
from phalanx.launch.nproc import cuda_available

__all__ = ["BackendNotes", "backend_note", "describe", "workers_backend"]


def workers_backend(
    backend: str | None,
    world_size: int,
    nproc: int,
    environ: Mapping[str, str] = os.environ,
    fewest_local: int = 0,
) -> tuple[str, str, bool]:
    """``(name, why, chosen)``: the workers' backend and why; ``chosen`` when the user named it
    (``--backend``, else the launcher's own ``PHALANX_BACKEND``) rather than left it to auto.
    ``fewest_local``: the rendezvous's :attr:`~phalanx.launch.rendezvous.Rendezvous.fewest_local`
    (0: unknown)."""
    given = (backend or environ.get("PHALANX_BACKEND") or "auto").lower()
    if given != "auto":
        return given, _placement(given, world_size, nproc), True
    one_machine = world_size > 1 and world_size == nproc
    name, why = auto_backend(cuda_available(), one_machine, fewest_local)
    if name == "gloo" and world_size == 1:
        why = "a single rank: nothing to share"
    elif name == "gloo" and world_size > nproc and not why:
        why = "CPU ranks on several machines"
    return name, why, False


def _placement(name: str, world_size: int, nproc: int) -> str:
    """What a chosen backend does with these ranks, where its name alone does not say."""
    if name != "shm":
        return ""
    if world_size > nproc:
        return "shared memory inside each machine, gloo between the machines"
    return "shared memory: every rank on this machine"


def describe(name: str, why: str, chosen: bool, before: str | None = None) -> str:
    """``"default backend X (why)"``, or ``"backend X (why)"`` when chosen: what the start-up
    line and ``phalanx doctor`` say of :func:`workers_backend`'s answer. ``before``: the
    previous generation's backend, when the default changed since."""
    if chosen:
        return f"backend {name}" + (f" ({why})" if why else "")
    if before is not None:
        why = f"changed from {before}: {why}; --backend {before} keeps {before}"
    elif name == "shm":
        why += "; --backend gloo opts out"
    return f"default backend {name}" + (f" ({why})" if why else "")


def backend_note(backend: str | None, world_size: int, nproc: int, fewest_local: int = 0) -> str:
    """``", default backend X (why)"`` (or ``", backend X"`` when chosen) for the start-up line."""
    return ", " + describe(*workers_backend(backend, world_size, nproc, fewest_local=fewest_local))


class BackendNotes:
    """The backend part of each generation's start-up line, which says when the default changed.

    One per agent: it remembers the backend of the generation before. An elastic job whose new
    generation has a node with a single rank has its auto backend turn from shm to gloo, and
    back when that node leaves or every node runs 2 or more again; the line says so, and how to
    keep one backend throughout.
    """

    def __init__(self, backend: str | None, environ: Mapping[str, str] = os.environ) -> None:
        self.backend = backend
        self.environ = environ
        self.last: str | None = None
        """The backend of the previous generation's workers (None before the first)."""

    def note(self, world_size: int, nproc: int, fewest_local: int = 0) -> str:
        """The note for a generation of ``world_size`` ranks, ``nproc`` of them on this node,
        ``fewest_local`` on the node with the fewest (0: unknown; see :func:`workers_backend`)."""
        name, why, chosen = workers_backend(
            self.backend, world_size, nproc, self.environ, fewest_local
        )
        before, self.last = self.last, name
        changed = None if chosen or before in (None, name) else before
        return ", " + describe(name, why, chosen, changed)
