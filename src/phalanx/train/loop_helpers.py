"""What the job loop needs besides the Job itself: timing, seeding, logging, batch moves.

Kept apart from :mod:`phalanx.train.job` so that module reads as the loop's story.
"""

from __future__ import annotations

import copy
import logging
import random
import sys
import time
from collections import UserDict
from collections.abc import Iterable, Sized
from typing import Any, cast

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "Timer",
    "batch_len",
    "batches_left",
    "configure_logging",
    "repoint",
    "seed_everything",
    "to_device",
]


class Timer:
    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0
        self._t: float | None = None

    def start_epoch(self) -> None:
        self._t = time.perf_counter()

    def count(self, n: int) -> None:
        now = time.perf_counter()
        if self._t is not None:
            self.seconds += now - self._t
        self._t = now
        self.samples += n

    def summary(self, world_size: int) -> dict[str, float]:
        secs = max(self.seconds, 1e-9)
        return {"samples_per_s": self.samples * world_size / secs, "train_seconds": self.seconds}


def repoint(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point an LR scheduler built on the user's optimizer at its sharded rebuild.

    The rebuild copied the parameter groups (``lr``, ``initial_lr``) the scheduler set up; its
    ``step`` gets the same marker torch's scheduler puts on an optimizer it wraps, so the
    "scheduler stepped before optimizer" check still works.
    """
    scheduler.optimizer = optimizer
    step = optimizer.step

    def marked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    marked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = marked  # type: ignore[method-assign]


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


class _JobOutput(logging.Handler):
    """The handler :func:`configure_logging` adds: "%(message)s" lines to ``sys.stderr`` as it is
    at each record (pytest and redirections replace it); silent once the program configures the
    root logger, whose handlers then show phalanx's records."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def configure_logging(rank: int) -> None:
    """Show the job's log lines (INFO on rank 0, WARNING on every rank) unless the program
    configured logging itself.

    phalanx's modules only log (``logging.getLogger(__name__)``); the one handler phalanx may
    add is this one, on "phalanx.train", and only when neither it nor a parent logger ("phalanx",
    the root) has a handler: no ``basicConfig``, ``dictConfig`` or handler of the program. A
    plain script, or one under ``phalanx run``, then shows "epoch 1 step 40: loss=..." as
    ``print`` would. The "phalanx" logger's level is set to INFO only where the program left it
    unset, so ``logging.getLogger("phalanx").setLevel(logging.ERROR)`` before or after ``Job()``
    silences the info lines. Records propagate as usual (other phalanx loggers keep Python's
    default: warnings to stderr when nothing is configured).
    """
    train = logging.getLogger("phalanx.train")
    if train.hasHandlers():
        return
    train.addHandler(_JobOutput(logging.INFO if rank == 0 else logging.WARNING))
    top = logging.getLogger("phalanx")
    if top.level == logging.NOTSET:
        top.setLevel(logging.INFO)


def _user_dict(value: object) -> bool:
    return isinstance(value, UserDict)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it moved to ``device``, its structure kept.

    Any nesting of what torch's pytree utilities know (tuples, lists, dicts, ``OrderedDict``,
    ``defaultdict``, namedtuples, ``deque``) comes back as the same types. A
    ``collections.UserDict`` (a Hugging Face ``BatchEncoding`` is one) comes back as a shallow
    copy of the same class (``copy.copy``: its other attributes kept) whose ``data`` dict holds
    the moved values. Anything else is left as it is.
    """

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        if isinstance(value, UserDict):
            moved = copy.copy(value)
            moved.data = to_device(value.data, device)
            return moved
        return value

    return tree_map(move, batch, is_leaf=_user_dict)


def batches_left(loader: Iterable[Any], sampler: Any) -> int | None:
    """Batches this epoch still has (fewer than ``len(loader)`` after a mid-epoch resume)."""
    if isinstance(loader, torch.utils.data.DataLoader) and loader.sampler is sampler is not None:
        size = loader.batch_size or 1
        left = int(cast(Any, sampler).remaining)
        return left // size if loader.drop_last else -(-left // size)
    return len(loader) if isinstance(loader, Sized) else None


def batch_len(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor (1 if it has none)."""
    for leaf in tree_leaves(batch, is_leaf=_user_dict):
        if isinstance(leaf, UserDict):
            return batch_len(leaf.data)
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1
