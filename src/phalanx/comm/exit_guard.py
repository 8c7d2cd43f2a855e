"""Exit without SIGABRT after gloo collectives: let gloo's threads drop their last work first.

torch 2.13's ``ProcessGroupGloo`` runs each collective on a ``pt_gloo_runloop`` thread, which
destroys the work object right after completing it. A work launched from an autograd hook (DDP's
gradient all-reduce, torch's or phalanx's) captures the thread-local state, which holds Python
objects, so that destruction needs the GIL. When the main thread finishes its script in that
instant, the interpreter is already finalizing: the gloo thread's ``PyEval_AcquireThread`` exits
the thread, the forced unwind meets a ``noexcept`` destructor, and the process dies with
"terminate called without an active exception" (SIGABRT), after the script itself succeeded.
Seed 001's toy DDP script did so in 5 of 15 runs under torchrun (pytorch/pytorch#179291 describes
the same finalization race).

The guard: an ``atexit`` handler, run while the interpreter is still whole, that releases the GIL
briefly when gloo's threads are alive, so they finish those destructions first. It costs 50 ms
at exit, and nothing in a process without gloo threads.

Two ways in: ``import phalanx`` installs it, and ``phalanx run`` installs it in every worker
before the script starts (:mod:`phalanx.launch.worker_site`), so a script that never imports
phalanx is guarded too. For that, this module imports nothing but the standard library (the
worker's hook loads this file alone, under :data:`HOOKED_NAME`, and must not import torch before
the script does). ``PHALANX_EXIT_GUARD=0`` turns the guard off both ways.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

TYPE_CHECKING = False  # not typing's: it costs milliseconds at each worker's start
if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["ENABLE_ENV", "GRACE_S", "HOOKED_NAME", "enabled", "install"]

GRACE_S = 0.05
"""How long the main thread holds back finalization at exit, with the GIL released."""
GLOO_THREAD = "pt_gloo_runloop"
ENABLE_ENV = "PHALANX_EXIT_GUARD"
"""``0`` in the environment: no exit guard, neither from ``import phalanx`` nor ``phalanx run``."""
HOOKED_NAME = "_phalanx_exit_guard"
"""The name this file has in ``sys.modules`` when a ``phalanx run`` worker's hook loaded it."""

_installed = False


def _gloo_threads_alive() -> bool:
    """True when this process has gloo worker threads (named ``pt_gloo_runloop`` by torch).

    Read from ``/proc/self/task`` (Linux); elsewhere, assume so when a group is initialized.
    ``destroy_process_group`` does not end them while a DDP module still holds the group.
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        dist = sys.modules.get("torch.distributed")  # never imported here: see the module doc
        return dist is not None and dist.is_available() and dist.is_initialized()
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().startswith(GLOO_THREAD):
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


def _let_gloo_threads_finish() -> None:
    if _gloo_threads_alive():
        time.sleep(GRACE_S)


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """False when ``PHALANX_EXIT_GUARD`` turns the guard off: ``0``, ``false``, ``no`` or ``off``
    in any case, as :func:`phalanx.comm.flags.env_flag` reads them."""
    return environ.get(ENABLE_ENV, "").strip().lower() not in ("0", "false", "no", "off")


def install() -> None:
    """Register the exit guard once per process, unless ``PHALANX_EXIT_GUARD=0``.

    Importing :mod:`phalanx.comm` calls it; so does the start-up hook of ``phalanx run``'s
    workers, with its own copy of this module: the handler is registered once either way.
    """
    global _installed
    hooked = sys.modules.get(HOOKED_NAME)
    if _installed or getattr(hooked, "_installed", False) or not enabled():
        return
    atexit.register(_let_gloo_threads_finish)
    _installed = True
