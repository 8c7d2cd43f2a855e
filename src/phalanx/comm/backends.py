"""The backend names and the one rule that "auto" follows (pure: no process group, no store).

:func:`auto_backend` is read by ``init_process_group`` (``group.resolve_backend``), by the
launcher's start-up line (``launch/backend_note.py``) and by ``phalanx doctor``, so that what
they say is what the workers get. It lives apart from ``group.py`` and from the shared-memory
package so that the launcher and the doctor can ask it without importing either.
"""

from __future__ import annotations

import platform

__all__ = ["BACKENDS", "auto_backend", "shm_unusable"]

BACKENDS = ("auto", "gloo", "nccl", "mpi", "shm")
"""What ``backend=`` (``phalanx run --backend``, ``PHALANX_BACKEND``) may name."""

_SHM_MACHINES = ("x86_64", "amd64")


def shm_unusable() -> str | None:
    """None when this machine can run the shared-memory backend, else the reason it cannot.

    Only Linux on x86-64: the backend publishes data with plain stores and relies on x86-64's
    total store order (``shm/sync.py``), and calls the x86-64 futex syscall (``shm/futex.py``).
    """
    machine = platform.machine().lower()
    if platform.system() != "Linux" or machine not in _SHM_MACHINES:
        return f"{platform.system()} on {platform.machine()} (it needs Linux on x86-64)"
    return None


def auto_backend(gpu: bool, one_machine: bool) -> tuple[str, str]:
    """What backend "auto" means for a rank, and why in a few words ("" when nothing to say).

    NCCL for a rank with a GPU; shm for CPU ranks that all share this machine, where shm can
    run (:func:`shm_unusable`); else gloo.

    Args:
        gpu: This rank has a CUDA device.
        one_machine: A launcher put every rank of the job on this machine
            (``group.shares_one_machine``).
    """
    if gpu:
        return "nccl", "GPU ranks"
    if not one_machine:
        return "gloo", ""
    cannot = shm_unusable()
    if cannot is not None:
        return "gloo", f"CPU ranks on one machine, but shm cannot run on {cannot}"
    return "shm", "CPU ranks on one machine"
