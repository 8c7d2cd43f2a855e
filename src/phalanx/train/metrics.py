"""MetricsLogger: average scalars over the ranks in one all-reduce; rank 0 writes JSONL/TensorBoard.

:meth:`MetricsLogger.log` packs every metric of the call into one float64 tensor behind a small
header and all-reduces it once. The packet has a fixed size (``PACKET`` values), whatever the
number of metrics, so ranks that disagree on the keys never send tensors of different shapes
(which gloo answers with a process abort); calls with more metrics than fit send a few more
packets, which every rank agrees on once the header has proved the key sets equal.

The header checks the call cheaply: each rank packs ``1``, ``1`` if one of its values is not a
number (so that every rank raises, not only that one), and for three 16-bit hashes ``h``
of its sorted key names both ``h`` and ``h²``. After the sum, every rank had the same ``h`` exactly
when ``R·Σh² == (Σh)²`` (Cauchy–Schwarz is tight only for equal terms); the values stay below
2^53 for up to 2^21 ranks, so the float64 arithmetic is exact. On a mismatch every rank sees it
at once, gathers the key sets (a second collective that all ranks take) and raises naming them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch
import torch.distributed as dist

from phalanx._optional import require
from phalanx.comm.collectives import all_reduce

__all__ = ["MetricsLogger"]

log = logging.getLogger(__name__)

PACKET = 64
"""float64 values per all-reduce (512 bytes: latency-bound, so as cheap as one value)."""
_N_HASHES = 3
_HEADER = 2 + 2 * _N_HASHES


def _key_hashes(keys: list[str]) -> list[int]:
    digest = hashlib.blake2b("\0".join(keys).encode(), digest_size=2 * _N_HASHES).digest()
    return [int.from_bytes(digest[2 * i : 2 * i + 2], "big") for i in range(_N_HASHES)]


def _header(keys: list[str], bad: bool) -> list[float]:
    out = [1.0, float(bad)]
    for h in _key_hashes(keys):
        out += [float(h), float(h * h)]
    return out


def _keys_agree(header: list[float]) -> bool:
    ranks = int(header[0])
    pairs = zip(header[2::2], header[3::2])
    return all(int(sq) * ranks == int(s) ** 2 for s, sq in pairs)


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _json_value(v: float) -> float | None:
    return v if math.isfinite(v) else None  # strict JSON has no NaN/Infinity


def _raise_not_numbers(ranks: int, local_bad: list[str]) -> None:
    here = f"; here: {local_bad}" if local_bad else ""
    raise ValueError(
        f"MetricsLogger.log: {ranks} rank(s) passed metrics that are not numbers{here}; pass "
        "floats, ints or one-element tensors"
    )


class MetricsLogger:
    """Average metrics over ranks and write them on rank 0 (JSON lines, optionally TensorBoard).

    Args:
        path: JSONL file that rank 0 appends ``{"step", "time", **metrics}`` lines to (one per
            call, flushed; non-finite values are written as null). None: no file.
        tensorboard_dir: Also write scalars to TensorBoard here (rank 0). Needs the optional
            extra: ``pip install 'phalanx[tensorboard]'``.
        group: Process group to average over (default: the whole world). Without an initialised
            process group the logger works alone and averages nothing.

    Raises:
        ImportError: on every rank, when ``tensorboard_dir`` is given and tensorboard is missing.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.path = None if path is None else Path(path)
        self._file: IO[str] | None = None
        self._writer: Any = None
        if tensorboard_dir is not None:
            self._writer = self._tensorboard(tensorboard_dir)

    @classmethod
    def for_job(
        cls,
        path: str | os.PathLike[str] | None,
        checkpoint_dir: str | os.PathLike[str] | None,
        tensorboard_dir: str | None,
        group: Any,
    ) -> MetricsLogger:
        """A job's logger: ``path``, else ``checkpoint_dir/metrics.jsonl``, else no file."""
        if path is None and checkpoint_dir is not None:
            path = os.path.join(checkpoint_dir, "metrics.jsonl")
        return cls(path, tensorboard_dir=tensorboard_dir, group=group)

    def _tensorboard(self, logdir: str | os.PathLike[str]) -> Any:
        # Checked on every rank so that all of them fail alike; only rank 0 imports and writes.
        require("tensorboard", f"tensorboard_dir={str(logdir)!r}")
        if self._rank() != 0:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(logdir))

    def _world_size(self) -> int:
        distributed = dist.is_available() and dist.is_initialized()
        return dist.get_world_size(self.group) if distributed else 1

    @property
    def is_writer(self) -> bool:
        """True on the rank that writes (rank 0 of the group)."""
        return self._rank() == 0

    def _rank(self) -> int:
        distributed = dist.is_available() and dist.is_initialized()
        return dist.get_rank(self.group) if distributed else 0

    def log(self, step: int, **metrics: float) -> dict[str, float]:
        """Average ``metrics`` over the group's ranks; rank 0 writes them. Every rank must call.

        Args:
            step: Global step, written with the values.
            **metrics: Scalars (floats, ints or one-element tensors); the same names on every rank.

        Returns:
            The averaged metrics, on every rank.

        Raises:
            ValueError: on every rank when the ranks passed different metric names (naming
                each rank's), a value that is not a number, or a metric called "time".
        """
        keys = sorted(metrics)
        converted = [_as_float(metrics[k]) for k in keys]
        bad = [k for k, v in zip(keys, converted) if v is None]
        values = [math.nan if v is None else v for v in converted]
        if self._world_size() > 1:
            values = self._average(keys, values, bad)
        elif bad:
            _raise_not_numbers(1, bad)
        if "time" in metrics:  # after the collective: every rank has the same keys, all raise
            raise ValueError("MetricsLogger.log: the metric name 'time' is reserved; rename it")
        averaged = dict(zip(keys, values))
        self._write(step, averaged)
        return averaged

    def _average(self, keys: list[str], values: list[float], bad: list[str]) -> list[float]:
        room = PACKET - _HEADER
        first = torch.zeros(PACKET, dtype=torch.float64)
        first[:_HEADER] = torch.tensor(_header(keys, bool(bad)), dtype=torch.float64)
        first[_HEADER : _HEADER + min(room, len(values))] = torch.tensor(values[:room])
        all_reduce(first, group=self.group)
        if not _keys_agree(first[:_HEADER].tolist()):
            self._raise_mismatch(keys)
        if first[1] > 0:
            _raise_not_numbers(int(first[1]), bad)
        sums = first[_HEADER : _HEADER + len(values)].tolist()
        for start in range(room, len(values), PACKET):  # only for very many metrics
            chunk = torch.tensor(values[start : start + PACKET], dtype=torch.float64)
            all_reduce(chunk, group=self.group)
            sums += chunk.tolist()
        return [s / int(first[0]) for s in sums]

    def _raise_mismatch(self, keys: list[str]) -> None:
        gathered: list[Any] = [None] * self._world_size()
        from phalanx.comm.objects import all_gather_object  # JSON, not pickle

        all_gather_object(gathered, keys, group=self.group)
        listing = "; ".join(f"rank {r}: {k}" for r, k in enumerate(gathered))
        raise ValueError(
            f"MetricsLogger.log: ranks passed different metric names ({listing}); "
            "every rank must log the same names in each call"
        )

    def log_local(self, step: int, **metrics: float) -> dict[str, float]:
        """Write ``metrics`` as they are, on rank 0 only, without communication.

        For values only rank 0 has (a learning rate, an evaluation score). Other ranks may call
        it too; they write nothing.
        """
        values = {k: float(v) for k, v in metrics.items()}
        if "time" in values:
            raise ValueError("MetricsLogger.log_local: the metric name 'time' is reserved")
        self._write(step, values)
        return values

    def _write(self, step: int, values: dict[str, float]) -> None:
        if self._rank() != 0:
            return
        if self.path is not None:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            row: dict[str, Any] = {"step": step, "time": time.time()}
            row.update({k: _json_value(v) for k, v in values.items()})
            self._file.write(json.dumps(row, allow_nan=False) + "\n")
            self._file.flush()
        if self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        """Close the JSONL file and the TensorBoard writer (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
