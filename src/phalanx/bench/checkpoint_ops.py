"""How each implementation of ``phalanx bench checkpoint`` saves and loads one rank's state.

Every rank holds the same model (as under data parallelism) and every call is collective over
the default group:

- ``phalanx``: :func:`phalanx.checkpoint.save` / ``load`` (safetensors, crc32c, fsync, atomic
  commit; rank 0 writes the replicated state, on a few threads);
- ``dcp``: ``torch.distributed.checkpoint.save`` / ``load`` of the model's state dict (DCP
  spreads the replicated tensors' writes over the ranks);
- ``raw``: the floor: each rank writes its share of the tensors' bytes (about 1/world of them)
  to one file with ``write`` + ``fsync``, and every rank reads all of them back with
  ``readinto`` straight into its tensors: no format, no checksum, no atomic commit;
- ``phalanx_async``: ``save(async_=True)`` then ``checkpoint.wait()``;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` (its defaults: a thread, a new
  CPU copy per save) on a gloo group of its own, as DCP's documentation asks, then
  ``result()``;
- ``dcp_async_process``: the same with ``async_checkpointer_type=PROCESS``: DCP's writer in a
  process of its own (no share of the training process's GIL).

An asynchronous save is loaded back with its synchronous twin's loader.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "ASYNC",
    "SYNC",
    "AsyncImpl",
    "Rank",
    "SyncImpl",
    "evict",
    "make_model",
    "stop_dcp_writer",
]


def make_model(mb: float) -> nn.Module:
    """Linear 1024x1024 layers (4 MiB of weights each) adding up to about ``mb`` MB."""
    layers = max(1, round(mb * 1e6 / (1024 * 1025 * 4)))
    return nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(layers)))


@dataclass
class Rank:
    """One rank's side of the benchmark: its model, and DCP's group for asynchronous saves."""

    model: nn.Module
    rank: int
    world: int
    dcp_group: dist.ProcessGroup | None = None

    def state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


@dataclass(frozen=True)
class SyncImpl:
    """A synchronous save and its load."""

    name: str
    save: Callable[[Rank, Path], None]
    load: Callable[[Rank, Path], None]


@dataclass(frozen=True)
class AsyncImpl:
    """An asynchronous save: ``start`` returns what ``finish`` waits on (``running`` while it
    writes); loaded by ``load``."""

    name: str
    start: Callable[[Rank, Path], Any]
    finish: Callable[[Any], None]
    running: Callable[[Any], bool]
    load: Callable[[Rank, Path], None]


def _raw_share(r: Rank, rank: int) -> list[torch.Tensor]:
    """The tensors rank ``rank`` writes: every world-th one, by decreasing size."""
    tensors = sorted(r.state().values(), key=lambda t: -t.numel() * t.element_size())
    return tensors[rank :: r.world]


def _bytes(t: torch.Tensor) -> Any:
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _raw_save(r: Rank, path: Path) -> None:
    path.mkdir(exist_ok=True)
    with open(path / f"raw-{r.rank}.bin", "wb", buffering=0) as f:
        for t in _raw_share(r, r.rank):
            f.write(_bytes(t))
        os.fsync(f.fileno())


def _raw_load(r: Rank, path: Path) -> None:
    for rank in range(r.world):
        with open(path / f"raw-{rank}.bin", "rb", buffering=0) as f:
            for t in _raw_share(r, rank):
                f.readinto(_bytes(t))


def _dcp_save(r: Rank, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(r.state(), checkpoint_id=str(path))


def _dcp_load(r: Rank, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(r.state(), checkpoint_id=str(path))  # in place, into the model's tensors


def _dcp_start(r: Rank, path: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(r.state(), checkpoint_id=str(path), process_group=r.dcp_group)


def _dcp_process_start(r: Rank, path: Path) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    return dcp.async_save(
        r.state(),
        checkpoint_id=str(path),
        process_group=r.dcp_group,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )


def _phalanx_save(r: Rank, path: Path) -> None:
    from phalanx import checkpoint

    checkpoint.save(path, 1, model=r.model, keep_last=1)


def _phalanx_start(r: Rank, path: Path) -> None:
    from phalanx import checkpoint

    checkpoint.save(path, 1, model=r.model, keep_last=1, async_=True)


def _phalanx_finish(_: Any) -> None:
    from phalanx import checkpoint

    checkpoint.wait()


def _phalanx_running(_: Any) -> bool:
    from phalanx.checkpoint import background

    return background.running()


def _phalanx_load(r: Rank, path: Path) -> None:
    from phalanx import checkpoint

    checkpoint.load(path, model=r.model)


SYNC = (
    SyncImpl("phalanx", _phalanx_save, _phalanx_load),
    SyncImpl("dcp", _dcp_save, _dcp_load),
    SyncImpl("raw", _raw_save, _raw_load),
)
ASYNC = (
    AsyncImpl("phalanx_async", _phalanx_start, _phalanx_finish, _phalanx_running, _phalanx_load),
    AsyncImpl(
        "dcp_async", _dcp_start, lambda future: future.result(), lambda f: not f.done(), _dcp_load
    ),
    AsyncImpl(
        "dcp_async_process",
        _dcp_process_start,
        lambda future: future.result(),
        lambda f: not f.done(),
        _dcp_load,
    ),
)


def stop_dcp_writer() -> None:
    """End DCP's writer process (``dcp_async_process``) now, as its ``__del__`` does, rather
    than leave it to fail reading from its killed parent (torch 2.13 offers no public call)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
    del process  # its __del__ sends TERMINATE and joins


def evict(path: Path) -> None:
    """Drop the page cache of every file under ``path`` (``posix_fadvise(DONTNEED)``: the
    files' own pages only, no root needed; a hypervisor's cache below is out of reach)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
