"""The backend names and the one rule that "auto" follows (pure: no process group, no store).

:func:`auto_backend` is read by ``init_process_group`` (``group.resolve_backend``), by the
launcher's start-up line (``launch/backend_note.py``) and by ``phalanx doctor``, so that what
they say is what the workers get. It lives apart from ``group.py`` and from the shared-memory
package so that the launcher and the doctor can ask it without importing either.
"""

from __future__ import annotations

import platform

__all__ = ["BACKENDS", "HIERARCHICAL", "MIN_LOCAL_ENV", "SHM", "auto_backend", "shm_unusable"]

SHM = "shm"
"""phalanx's own backend (``comm/shm``), registered with torch by ``comm/plugin.py``."""
BACKENDS = ("auto", "gloo", "nccl", "mpi", SHM)
"""What ``backend=`` (``phalanx run --backend``, ``PHALANX_BACKEND``) may name."""

MIN_LOCAL_ENV = "PHALANX_MIN_LOCAL_WORLD_SIZE"
"""What ``phalanx run`` tells each worker: the fewest ranks that any node of the generation
can put on shared memory (its rank count; 0 on a node where shm cannot run)."""

HIERARCHICAL = (
    "hierarchical: shared memory inside each machine, gloo between them; "
    "measured faster than gloo across machines"
)
"""Why "auto" means shm for CPU ranks on several machines that each run 2 or more."""
SINGLE_RANK = "CPU ranks on several machines, one of them with a single rank"

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


def auto_backend(gpu: bool, one_machine: bool, fewest_local: int = 0) -> tuple[str, str]:
    """What backend "auto" means for a rank, and why in a few words ("" when nothing to say).

    NCCL for a rank with a GPU. For CPU ranks, where shm can run (:func:`shm_unusable`): shm
    when they all share this machine; shm too across machines when every machine runs 2 or
    more of them, where the group is hierarchical (shared memory inside each machine, gloo
    between them), measured faster than gloo alone at 100 Mbit/s and 1 Gbit/s (``phalanx bench
    hosts_backend``); else gloo. A machine with a single rank has nothing to share.

    Args:
        gpu: This rank has a CUDA device.
        one_machine: A launcher put every rank of the job on this machine
            (``group.shares_one_machine``).
        fewest_local: Across machines, the fewest ranks any machine of the job can put on
            shared memory (``phalanx run``'s ``PHALANX_MIN_LOCAL_WORLD_SIZE``: its rank count,
            0 where shm cannot run); 0 when unknown.
    """
    if gpu:
        return "nccl", "GPU ranks"
    if not one_machine and fewest_local < 2:
        return "gloo", SINGLE_RANK if fewest_local == 1 else ""
    cannot = shm_unusable()
    if cannot is not None:
        where = "on one machine" if one_machine else "on several machines"
        return "gloo", f"CPU ranks {where}, but shm cannot run on {cannot}"
    return "shm", "CPU ranks on one machine" if one_machine else HIERARCHICAL
