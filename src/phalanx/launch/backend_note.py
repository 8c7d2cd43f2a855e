"""What the workers' default backend will be, for the launcher's start-up line.

A worker that leaves the backend to phalanx (``phalanx.init_process_group()``, ``phalanx.Job``)
gets NCCL on a GPU, the shared-memory backend when every CPU rank runs on this machine, and
gloo otherwise (``phalanx.comm.group.resolve_backend``). The launcher says which, and how to
opt out, so a user never wonders what carried the job.
"""

from __future__ import annotations

import os

__all__ = ["backend_note"]


def backend_note(backend: str | None, world_size: int, nproc: int) -> str:
    """``", default backend X (...)"`` for the start-up line; empty when it says nothing new."""
    chosen = backend or os.environ.get("PHALANX_BACKEND")
    if chosen:
        return f", backend {chosen.lower()}"
    import torch

    if torch.cuda.is_available():
        return ", default backend nccl (GPU ranks)"
    if world_size > 1 and world_size == nproc:
        return ", default backend shm (CPU ranks on one machine; --backend gloo opts out)"
    return ", default backend gloo"
