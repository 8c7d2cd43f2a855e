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
"""

from __future__ import annotations

import atexit
import os
import time

import torch.distributed as dist

__all__ = ["GRACE_S", "install"]

GRACE_S = 0.05
"""How long the main thread holds back finalization at exit, with the GIL released."""
GLOO_THREAD = "pt_gloo_runloop"

_installed = False


def _gloo_threads_alive() -> bool:
    """True when this process has gloo worker threads (named ``pt_gloo_runloop`` by torch).

    Read from ``/proc/self/task`` (Linux); elsewhere, assume so when a group is initialized.
    ``destroy_process_group`` does not end them while a DDP module still holds the group.
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return dist.is_available() and dist.is_initialized()
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


def install() -> None:
    """Register the exit guard once per process (importing :mod:`phalanx.comm` does)."""
    global _installed
    if not _installed:
        atexit.register(_let_gloo_threads_finish)
        _installed = True
