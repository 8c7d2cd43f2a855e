"""Training state <-> checkpoint sections: model, optimizer, scheduler, per-rank RNG and sampler.

A *section* is one state dict stored as ``<name>.json`` (its structure, see ``structure.py``,
and the list of its tensor files) plus ``<name>.safetensors`` with its tensors, if any. Large
sections are split into ``<name>-00001.safetensors``, ... of about 64 MiB each, which are
written, checksummed and read on parallel threads. Rank 0 writes the replicated sections
(``model``, ``optimizer``, ``scheduler``); every rank writes ``rank-NNNNN`` with its own random
generators and sampler position.
"""

from __future__ import annotations

import json
import math
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from phalanx.checkpoint import structure
from phalanx.checkpoint.checksum import TensorBytes
from phalanx.checkpoint.format import encode, read_tensors
from phalanx.checkpoint.limits import (
    MAX_DEPTH,
    MAX_JSON_ENV,
    check_json_size,
    deeper_than,
    max_json_bytes,
    parse_json,
)
from phalanx.checkpoint.manifest import CheckpointError, Manifest, read_verified, safe_path

__all__ = ["Section", "StateMismatchError", "load_model", "parallel", "read_section", "unwrap"]

T = TypeVar("T")
_THREAD_PREFIX = "phalanx-ckpt-io"
SHARD_BYTES = 64 * 1024 * 1024
"""Tensor files are split into parts of about this size, written and read in parallel."""
MIN_PART_BYTES = 4 * 1024 * 1024
"""Sections are not split below parts of this size to give more ranks a share."""


class StateMismatchError(CheckpointError, ValueError):
    """The checkpoint's model state has other keys or shapes than the model it is loaded into."""


_POOL: ThreadPoolExecutor | None = None


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: start a new pool when needed."""
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_pool)


def parallel(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``calls`` on a few threads (file I/O and hashing release the GIL); keep the order.

    The threads are kept for the next call (starting threads costs milliseconds on a loaded
    machine, a good part of saving a small checkpoint). Calls may nest: one running on the
    pool runs its own ``calls`` in line rather than wait on the pool it occupies.
    """
    global _POOL
    if len(calls) <= 1 or threading.current_thread().name.startswith(_THREAD_PREFIX):
        return [c() for c in calls]
    if _POOL is None:
        workers = min(max(4, os.cpu_count() or 1), 8)  # I/O waits: more threads than cores
        _POOL = ThreadPoolExecutor(workers, thread_name_prefix=_THREAD_PREFIX)
    if _pool_stopped():  # the interpreter is exiting and stopped the pools: go on in line
        return [c() for c in calls]
    return list(_POOL.map(lambda c: c(), calls))


def _pool_stopped() -> bool:
    """Whether the interpreter's shutdown stopped ``concurrent.futures``' thread pools."""
    from concurrent.futures import thread

    return bool(getattr(thread, "_shutdown", False))


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Split ``tensors`` (in order) into about equal parts of at most ~``limit`` bytes."""
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    target = sum(sizes.values()) / max(1, math.ceil(sum(sizes.values()) / limit))
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for k, t in tensors.items():
        if shards[-1] and filled + sizes[k] / 2 > target:
            shards.append({})
            filled = 0
        shards[-1][k] = t
        filled += sizes[k]
    return shards


@dataclass(frozen=True)
class Section:
    """One state dict split into a JSON structure and flat tensors, ready to write."""

    name: str
    structure: Any
    tensors: dict[str, torch.Tensor]

    @classmethod
    def of(cls, name: str, state: Any, what: str) -> Section:
        """Split ``state`` (errors name ``what`` and the key that cannot be stored)."""
        tree, tensors = structure.flatten(state, what)
        if deeper_than(tree, MAX_DEPTH - 1):  # load refuses deeper JSON (limits.py)
            raise ValueError(
                f"{what} nests deeper than a checkpoint stores ({MAX_DEPTH} levels of JSON, "
                f"a tuple counting 2 and a dict with non-string keys 3); flatten it"
            )
        return cls(name, tree, tensors)

    def tensor_files(self, parts: int = 1) -> dict[str, dict[str, torch.Tensor]]:
        """File name -> its tensors: ``name.safetensors``, ``name-00001.safetensors``, ... of at
        most ~SHARD_BYTES each, and at least ``parts`` files where the tensors allow it (and
        the parts stay over MIN_PART_BYTES)."""
        if not self.tensors:
            return {}
        total = sum(t.numel() * t.element_size() for t in self.tensors.values())
        limit = min(SHARD_BYTES, max(MIN_PART_BYTES, math.ceil(total / parts)))
        return {
            f"{self.name}-{i:05d}.safetensors" if i else f"{self.name}.safetensors": shard
            for i, shard in enumerate(_shards(self.tensors, limit))
        }

    def index(self, tensor_files: Sequence[str]) -> bytes:
        """The ``name.json`` file: the structure and the list of tensor files."""
        doc = {"tensor_files": list(tensor_files), "state": self.structure}
        raw = json.dumps(doc, separators=(",", ":")).encode()
        if len(raw) > max_json_bytes():  # load would refuse it
            raise ValueError(
                f"{self.name}.json would be {len(raw)} bytes, over the {max_json_bytes()}-byte "
                f"limit of a checkpoint JSON file; set {MAX_JSON_ENV} to raise it"
            )
        return raw

    def files(self) -> dict[str, list[bytes | TensorBytes]]:
        """File name -> buffers to write: the tensor files, then ``name.json``."""
        parts = self.tensor_files()
        out = {name: encode(tensors) for name, tensors in parts.items()}
        out[f"{self.name}.json"] = [self.index(list(parts))]
        return out


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP / DataParallel / torch.compile wrappers.

    A wrapper is recognised by its state dict: every key is the inner module's key prefixed
    with ``module.`` (DDP, DataParallel, Horovod-style wrappers) or ``_orig_mod.``
    (``torch.compile``). A model that merely has a submodule called ``module`` is kept whole.
    """
    for attr in ("module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module) and all(
            k.startswith(f"{attr}.") for k in model.state_dict(keep_vars=True)
        ):
            return unwrap(inner)
    return model


def _json(ckpt: Path, manifest: Manifest, name: str) -> dict[str, Any]:
    check_json_size(ckpt / name, manifest.entry(ckpt, name).bytes)  # before reading a byte
    doc = parse_json(read_verified(ckpt, manifest, name).numpy().tobytes(), ckpt / name)
    files = doc.get("tensor_files") if isinstance(doc, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise CheckpointError(f"{ckpt / name}: no list of tensor files ('tensor_files')")
    return doc


def read_tensor_file(ckpt: Path, manifest: Manifest, name: str) -> dict[str, torch.Tensor]:
    """The tensors of ``ckpt/name``, a file the manifest lists, verified as they are mapped."""
    entry = manifest.entry(ckpt, name)
    return read_tensors(safe_path(ckpt, name), entry)


def read_section(ckpt: Path, manifest: Manifest, name: str) -> Any:
    """Read and verify section ``name`` of the checkpoint in ``ckpt``; return its state."""
    doc = _json(ckpt, manifest, f"{name}.json")
    files = doc["tensor_files"]
    parts = parallel([partial(read_tensor_file, ckpt, manifest, f) for f in files])
    tensors: dict[str, torch.Tensor] = {}
    for file, part in zip(files, parts):
        if tensors.keys() & part.keys():
            raise CheckpointError(
                f"{ckpt / file}: repeats tensors {sorted(tensors.keys() & part.keys())}"
            )
        tensors.update(part)
    return structure.unflatten(doc.get("state"), tensors, str(ckpt / f"{name}.json"))


def _shape(t: Any) -> tuple[int, ...] | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _report(where: str, missing: list[str], unexpected: list[str], mismatched: list[str]) -> str:
    lines = [f"{where} does not fit the model:"]
    for label, items in (
        ("missing in the checkpoint", missing),
        ("unexpected (not in the model)", unexpected),
        ("shape mismatch", mismatched),
    ):
        if items:
            lines.append(f"  {label} ({len(items)}): " + ", ".join(items))
    return "\n".join(lines)


def load_model(model: nn.Module, state: dict[str, Any], strict: bool, where: str) -> None:
    """Load ``state`` into ``model``, listing missing, unexpected and mismatched keys.

    Raises:
        StateMismatchError: with the full list, when ``strict`` and anything differs (with
            ``strict=False`` the matching entries load and a warning lists the rest).
    """
    module = unwrap(model)
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [k for k in own if k in state and _shape(state[k]) != _shape(own[k])]
    mismatched = [f"{k}: checkpoint {_shape(state[k])}, model {_shape(own[k])}" for k in wrong]
    if missing or unexpected or mismatched:
        report = _report(where, missing, unexpected, mismatched)
        if strict:
            raise StateMismatchError(f"{report}\nPass strict=False to load the matching entries.")
        warnings.warn(
            f"{report}\nLoaded the {len(own) - len(missing) - len(mismatched)} "
            f"matching entries (strict=False).",
            stacklevel=3,
        )
        bad = set(unexpected) | set(wrong)
        state = {k: v for k, v in state.items() if k not in bad}
    module.load_state_dict(state, strict=strict)


def load_into(obj: Any, state: Any, what: str, where: str) -> None:
    """``obj.load_state_dict(state)``, naming the checkpoint file when it does not fit."""
    try:
        obj.load_state_dict(state)
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as exc:
        raise CheckpointError(
            f"{where}: the saved {what} state does not fit the {what} "
            f"({type(obj).__name__}) it is loaded into: {exc}"
        ) from exc
