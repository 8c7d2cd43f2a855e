"""Atomic, pickle-free checkpoints with resume: ``save``, ``load``, ``latest``.

::

    from phalanx import checkpoint

    info = checkpoint.load("ckpt", model=ddp, optimizer=opt, scheduler=sched, sampler=sampler)
    start = 0 if info is None else info.step
    ...
    checkpoint.save("ckpt", step, model=ddp, optimizer=opt, scheduler=sched, sampler=sampler,
                    extra={"epoch": epoch})

Layout of ``ckpt/step-000123/``: ``model.safetensors`` (plus ``model-00001.safetensors``, ... for
models over 64 MiB) and ``model.json``, ``optimizer.*``, ``scheduler.json`` (written once, by rank
0), ``rank-00000.*``, ``rank-00001.*``, ... (each rank's RNG and sampler state) and
``manifest.json`` (size and crc32c of every file); ``ckpt/latest`` names the committed one. Tensors
are safetensors and everything else JSON: loading never unpickles. ``save`` writes a temporary
directory, fsyncs, renames and then updates ``latest``, so a crash at any point leaves the previous
checkpoint in force (fault injection for tests: ``PHALANX_CHECKPOINT_FAULT``, see
:mod:`phalanx.checkpoint.atomic`). Ranks wait for rank 0's commit on the rendezvous store, not in a
collective, so a long write cannot trip the collective timeout (see ``sync.py``). ``save(...,
async_=True)`` copies the state to host staging buffers, returns, and writes and commits on a
background thread; :func:`wait` (and the next ``save``, ``load``) waits for it and raises its error
(see :mod:`phalanx.checkpoint.background`). Plain ``torch.save`` state dicts come in through
:func:`import_torch_state_dict`. A checkpoint is untrusted input: every size, count and depth read
from one is bounded before use, only regular files are opened, and a crafted file is a
:class:`CheckpointError` naming it (see :mod:`phalanx.checkpoint.limits`). :func:`to_dcp` /
:func:`from_dcp` convert to and from torch DCP (model, optimizer, scheduler, objects; its pickled
metadata built as data by :mod:`~phalanx.checkpoint.dcp_pickle`), :func:`to_hf` /
:func:`from_hf` to and from Hugging Face ``save_pretrained`` weights. The four converters load on
first use: torch DCP takes seconds to import, and a job that only saves and loads (or a
parameter-server worker whose heartbeats wait on that import) must not pay it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from phalanx.checkpoint.background import wait
from phalanx.checkpoint.catalog import latest
from phalanx.checkpoint.errors import CheckpointError, ChecksumError
from phalanx.checkpoint.loading import CheckpointInfo, load
from phalanx.checkpoint.saving import save
from phalanx.checkpoint.sections import StateMismatchError
from phalanx.checkpoint.torch_import import import_torch_state_dict

if TYPE_CHECKING:  # loaded by __getattr__ on first use; imported here for type checkers only
    from phalanx.checkpoint.dcp_interop import from_dcp, to_dcp
    from phalanx.checkpoint.hf_interop import from_hf, to_hf

_CONVERTERS = {
    "from_dcp": "phalanx.checkpoint.dcp_interop",
    "to_dcp": "phalanx.checkpoint.dcp_interop",
    "from_hf": "phalanx.checkpoint.hf_interop",
    "to_hf": "phalanx.checkpoint.hf_interop",
}

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "ChecksumError",
    "StateMismatchError",
    "from_dcp",
    "from_hf",
    "import_torch_state_dict",
    "latest",
    "load",
    "save",
    "to_dcp",
    "to_hf",
    "wait",
]


def __getattr__(name: str) -> Any:
    # PEP 562: runs only for names not set yet, i.e. the converters before their first use.
    if name in _CONVERTERS:
        value = getattr(importlib.import_module(_CONVERTERS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_CONVERTERS})
