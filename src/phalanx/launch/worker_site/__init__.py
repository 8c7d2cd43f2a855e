"""The exit guard in every worker of ``phalanx run``, also in scripts that never import phalanx.

torch 2.13 can kill a process with SIGABRT after its script ended well, when gloo's thread still
drops a work as the interpreter finalizes (:mod:`phalanx.comm.exit_guard` says how).
``import phalanx`` installs the guard against it; an unchanged torch script does not import
phalanx, so the launcher installs it: each worker gets this folder first on its PYTHONPATH, and
its interpreter imports :file:`sitecustomize.py` from here at start-up, as ``site`` imports any
``sitecustomize`` it finds on the path, before the script runs.

The worker's command line stays torchrun's (``python -u script.py``, ``-m``, ``--run-path``,
``--no-python``), so ``sys.argv``, ``__main__``, ``__file__``, ``sys.path[0]``, tracebacks,
exit codes and signals are untouched. The hook loads ``exit_guard.py`` alone (no torch, no
phalanx), takes this folder off ``sys.path``, puts the user's PYTHONPATH back in ``os.environ``
(or unsets it) and then runs the ``sitecustomize`` it shadowed, if there is one. What remains
visible to the script: ``_phalanx_exit_guard`` in ``sys.modules`` (and this ``sitecustomize``,
when there was no other), and the guard's 50 ms at exit when gloo's threads are alive.

Not covered: an interpreter started with ``-S``, ``-E`` or ``-I`` (no ``sitecustomize``, or no
PYTHONPATH), and the processes a worker starts itself (they get the user's PYTHONPATH back, as
under torchrun; a script that runs gloo in ``torch.multiprocessing.spawn`` children guards them
with ``import phalanx``). ``PHALANX_EXIT_GUARD=0`` turns it off.

Accelerate's CPU trap: on CPU, Accelerate (and the Hugging Face Trainer, which runs on it)
ignores WORLD_SIZE unless ACCELERATE_USE_CPU=1, under torchrun too, so each rank trains alone
with no error. For CPU workers of a job of 2 or more ranks, where the user did not set
ACCELERATE_USE_CPU, the hook sets it when the script looks for ``accelerate``, and rank 0 says so
in one line (:func:`accelerate_env`); a script that never imports Accelerate sees no change.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from phalanx.comm import exit_guard
from phalanx.launch.worker_site.sitecustomize import ACCELERATE_ENV, USER_PYTHONPATH_ENV

__all__ = ["ACCELERATE_ENV", "HOOK_DIR", "USER_PYTHONPATH_ENV", "accelerate_env", "site_env"]

HOOK_DIR = os.path.dirname(os.path.abspath(__file__))
"""The folder a worker's PYTHONPATH starts with: it holds the hook, ``sitecustomize.py``."""


def site_env(base: Mapping[str, str]) -> dict[str, str]:
    """PYTHONPATH (and the user's own, kept for the hook to put back) that makes a worker with
    environment ``base`` run the hook; empty when ``PHALANX_EXIT_GUARD=0``."""
    if not exit_guard.enabled(base):
        return {}
    user = base.get("PYTHONPATH")
    env = {"PYTHONPATH": os.pathsep.join([HOOK_DIR, user]) if user else HOOK_DIR}
    if user is not None:
        env[USER_PYTHONPATH_ENV] = user
    return env


def accelerate_env(base: Mapping[str, str], cpu: bool, world_size: int) -> dict[str, str]:
    """What makes Accelerate see the job's ranks on CPU workers: the hook's cue
    (``PHALANX_ACCELERATE_USE_CPU=1``: ACCELERATE_USE_CPU=1 once the script looks for
    ``accelerate``), or ACCELERATE_USE_CPU=1 itself where the hook is off. Empty for GPU
    workers, a single rank, or when the user set ACCELERATE_USE_CPU."""
    if not cpu or world_size < 2 or "ACCELERATE_USE_CPU" in base:
        return {}
    if not exit_guard.enabled(base):  # no hook to wait for the import
        return {"ACCELERATE_USE_CPU": "1"}
    return {ACCELERATE_ENV: "1"}
