"""Atomic, pickle-free checkpoints with resume: ``save``, ``load``, ``latest``.

::

    from phalanx import checkpoint

    info = checkpoint.load("ckpt", model=ddp, optimizer=opt, scheduler=sched, sampler=sampler)
    start = 0 if info is None else info.step
    ...
    checkpoint.save("ckpt", step, model=ddp, optimizer=opt, scheduler=sched, sampler=sampler,
                    extra={"epoch": epoch})

Layout of ``ckpt/step-000123/``: ``model.safetensors`` (plus ``model-00001.safetensors``, ...
for models over 64 MiB) and ``model.json``, ``optimizer.*``, ``scheduler.json`` (written once,
by rank 0), ``rank-00000.*``, ``rank-00001.*``, ... (each rank's RNG and sampler state) and
``manifest.json`` (size and crc32c of every file); ``ckpt/latest`` names the committed one.
Tensors are safetensors and everything else JSON: loading never unpickles. ``save`` writes a
temporary directory, fsyncs, renames and then updates ``latest``, so a crash at any point
leaves the previous checkpoint in force (fault injection for tests: ``PHALANX_CHECKPOINT_FAULT``,
see :mod:`phalanx.checkpoint.atomic`). Ranks wait for rank 0's commit on the rendezvous store,
not in a collective, so a long write cannot trip the collective timeout (see ``sync.py``).
Plain ``torch.save`` state dicts come in through :func:`import_torch_state_dict`. A checkpoint
is untrusted input: every size, count and depth read from one is bounded before use, only regular
files are opened, and a crafted file is a :class:`CheckpointError` naming it (see
:mod:`phalanx.checkpoint.limits`).
"""

from __future__ import annotations

from phalanx.checkpoint.catalog import latest
from phalanx.checkpoint.errors import CheckpointError, ChecksumError
from phalanx.checkpoint.loading import CheckpointInfo, load
from phalanx.checkpoint.saving import save
from phalanx.checkpoint.sections import StateMismatchError
from phalanx.checkpoint.torch_import import import_torch_state_dict

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "ChecksumError",
    "StateMismatchError",
    "import_torch_state_dict",
    "latest",
    "load",
    "save",
]
