"""Hogwild (Recht et al., 2011): N processes update one shared model without locks.

``model.share_memory()`` moves every parameter and buffer into shared memory; the processes
receive the model through ``torch.multiprocessing``'s pickler, which sends the shared-memory
handles instead of copies, so every ``optimizer.step()`` in any process writes the same storage
(seed 000). Recht et al. show that for sparse-enough updates the races between these unlocked
writes barely slow convergence, while no process ever waits for another.

Processes are started with ``spawn`` or ``forkserver`` only, and supervised by
:class:`phalanx.launch.SpawnContext` (one deadline, first failure stops the others, tracebacks
come back as text).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from phalanx.hogwild.plan import check_train_args, shard_indices
from phalanx.launch.spawn import SpawnContext
from phalanx.launch.workers import die_with_parent

__all__ = ["train"]

_PRELOAD = ["torch", "phalanx"]  # the forkserver imports torch once; each child then starts fast


@check_train_args
def train(
    model: nn.Module,
    train_fn: Callable[..., Any],
    num_processes: int,
    *,
    dataset: Sequence[Any] | torch.utils.data.Dataset[Any] | None = None,
    args: tuple[Any, ...] = (),
    start_method: str = "spawn",
    timeout: float | None = None,
    seed: int = 0,
    num_threads: int = 1,
) -> nn.Module:
    """Train ``model`` Hogwild-style: ``num_processes`` processes update its shared parameters.

    Each process runs ``train_fn(rank, model, shard, *args)`` where ``model`` is the same
    shared-memory model (its own optimizer over ``model.parameters()`` writes the shared
    storage) and ``shard`` is ``torch.utils.data.Subset(dataset, shard_indices(...))``, the
    strided split ``DistributedSampler`` would give this rank, or None without ``dataset``.
    Before ``train_fn`` runs, the process calls ``torch.set_num_threads(num_threads)`` and
    seeds ``torch`` and ``random`` with ``seed + rank``.

    Args:
        model: The model to train. Its parameters and buffers are moved into shared memory
            in place (a no-op for CUDA tensors, which travel by CUDA IPC); existing gradients
            are dropped so that each process accumulates its own.
        train_fn: A module-level (picklable) function ``(rank, model, shard, *args)``.
        num_processes: Number of processes, >= 1.
        dataset: Optional map-style data set (``__len__`` and ``__getitem__``) to shard.
        args: Further picklable arguments of ``train_fn``.
        start_method: ``"spawn"`` or ``"forkserver"`` (preloads torch: faster starts).
            ``"fork"`` is refused (ValueError): forked children deadlock in torch's OpenMP
            pool once the parent has run tensor math.
        timeout: One deadline in seconds for all processes; None waits indefinitely.
        seed: Base seed; process ``rank`` uses ``seed + rank``.
        num_threads: ``torch.set_num_threads`` in each process (1 suits one core each).

    Returns:
        ``model`` itself, whose shared parameters now hold every process's updates.

    Raises:
        ValueError: ``num_processes`` or ``num_threads`` < 1, ``timeout`` <= 0 or a bad
            ``start_method``.
        TypeError: an argument of the wrong type: ``train_fn`` not callable or not picklable
            (lambda, local function), ``dataset`` without ``__len__``...
        phalanx.launch.SpawnError: a process raised (``rank N failed: ...`` and its traceback),
            exited non-zero or was killed by a signal, or the deadline passed; all processes
            are stopped before it is raised.
    """
    model.zero_grad(set_to_none=True)  # a shared .grad would be summed into by every process
    model.share_memory()
    context = _start(
        model, train_fn, num_processes, start_method, timeout, (dataset, args, seed, num_threads)
    )
    context.join()
    return model


def _start(
    model: nn.Module,
    train_fn: Callable[..., Any],
    num_processes: int,
    start_method: str,
    timeout: float | None,
    options: tuple[Any, ...],
) -> SpawnContext:
    """Start the processes under one :class:`SpawnContext`; stop them all if a start fails."""
    ctx: Any = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs; harmless then
    return SpawnContext.start(
        ctx,
        num_processes,
        _process_entry,
        lambda rank, writer: (rank, num_processes, train_fn, model, options, writer),
        timeout=timeout,
        name="phalanx-hogwild",
    )


def _process_entry(
    rank: int,
    num_processes: int,
    train_fn: Callable[..., Any],
    model: nn.Module,
    options: tuple[Any, ...],
    conn: Any,
) -> None:
    """Child: set threads and seed, build the shard, run ``train_fn``; report a traceback."""
    # The direct parent is the caller (spawn) or the forkserver, which exits with the caller.
    die_with_parent(os.getppid())()
    dataset, args, seed, num_threads = options
    torch.set_num_threads(num_threads)
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    try:
        shard = None
        if dataset is not None:
            indices = shard_indices(len(dataset), rank, num_processes)
            shard = torch.utils.data.Subset(dataset, indices)
        train_fn(rank, model, shard, *args)
    except SystemExit:
        raise  # SpawnContext reports the exit code
    except BaseException:
        conn.send(traceback.format_exc())
        conn.close()
        sys.exit(1)
    conn.close()
