"""Converting between phalanx checkpoints and Hugging Face ``save_pretrained`` weights.

::

    from phalanx import checkpoint

    checkpoint.to_hf("ckpt", "hf_model", max_shard_bytes=2 * 1024**3)
    config.save_pretrained("hf_model")  # the weights need the model's config.json beside them
    model = transformers.AutoModelForCausalLM.from_pretrained("hf_model")

    checkpoint.from_hf("hf_model", "ckpt2")  # then checkpoint.load("ckpt2", model=...)

``to_hf`` writes the model's state dict as ``save_pretrained`` does: ``model.safetensors`` when
it fits in ``max_shard_bytes``, else ``model-00001-of-0000N.safetensors``, ... and
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {key:
file}}``), with the safetensors library, bit-exact. ``from_hf`` reads either form back. The
index is untrusted input, bounded as phalanx's own JSON files are (regular file, size cap,
nesting cap, see :mod:`phalanx.checkpoint.limits`); every file it names must be a plain file
name in the same directory, and every tensor of the files must be where the index says.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from phalanx._check import check_int
from phalanx.checkpoint.errors import CheckpointError
from phalanx.checkpoint.interop_state import (
    checkpoint_dir,
    read_state,
    single_process,
    source_dir,
    target_dir,
    write_state,
)
from phalanx.checkpoint.limits import open_regular, read_json

__all__ = ["INDEX", "SINGLE", "from_hf", "to_hf"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DEFAULT_SHARD = 5 * 1000**3  # save_pretrained's default "5GB"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shards(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Split ``state`` in order into files of at most ``limit`` bytes (a larger tensor alone),
    as ``save_pretrained`` does."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for key, t in state.items():
        if shards[-1] and filled + _nbytes(t) > limit:
            shards.append({})
            filled = 0
        shards[-1][key] = t
        filled += _nbytes(t)
    return shards


def _model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    state, _ = read_state(ckpt)
    model = state.get("model")
    if not isinstance(model, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()
    ):
        raise CheckpointError(f"{ckpt}: holds no model state of named tensors to export")
    # safetensors refuses tensors sharing memory; the checkpoint's are views of its files.
    return {k: v.detach().contiguous().clone() for k, v in model.items()}


def to_hf(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_bytes: int = _DEFAULT_SHARD,
) -> Path:
    """Write the model of the phalanx checkpoint ``src`` as Hugging Face weights into ``dst``.

    Args:
        src: A checkpoint (``step-NNNNNN``) or a directory given to ``save`` (its newest).
        dst: The directory to write the ``.safetensors`` files (and index) into.
        max_shard_bytes: Largest file (a tensor larger than this gets a file of its own).

    Returns:
        ``dst`` as a Path.
    """
    single_process("to_hf")
    out = target_dir(dst, "to_hf")
    limit = check_int("max_shard_bytes", max_shard_bytes, min=1, where="to_hf")
    state = _model_state(checkpoint_dir(src, "to_hf"))
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(state, limit)
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata={"format": "pt"})
        return out
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(_nbytes(t) for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out


def _weight_map(directory: Path) -> dict[str, list[str]]:
    """File -> the keys the index puts in it (``model.safetensors`` alone without an index)."""
    index = directory / INDEX
    if not index.exists():
        if not (directory / SINGLE).exists():
            raise CheckpointError(f"{directory}: neither {INDEX} nor {SINGLE}; not HF weights")
        return {SINGLE: []}
    doc = read_json(index)  # regular file, size and depth capped
    mapping = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(mapping, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
    ):
        raise CheckpointError(f"{index}: no 'weight_map' of tensor names to file names")
    files: dict[str, list[str]] = {}
    for key, name in mapping.items():
        if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise CheckpointError(f"{index}: {name!r} is not a plain file name of {directory}")
        files.setdefault(name, []).append(key)
    return files


def _read_file(path: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path``, which must hold exactly ``keys`` (if any)."""
    try:
        open_regular(path).close()  # refuses a FIFO, a device or a directory before safetensors
    except OSError as exc:
        listed = f"listed in {path.parent / INDEX}" if keys else "expected"
        raise CheckpointError(f"{path}: {listed}, but cannot be read ({exc.strerror})") from None
    try:
        with safe_open(str(path), framework="pt") as f:
            found = list(f.keys())
            if keys and sorted(found) != sorted(keys):
                raise CheckpointError(
                    f"{path}: holds {sorted(set(found) - set(keys))[:5]} not in the index and "
                    f"lacks {sorted(set(keys) - set(found))[:5]}"
                )
            return {k: f.get_tensor(k) for k in found}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from None


def from_hf(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, step: int = 0) -> Path:
    """Write the Hugging Face weights in ``src`` as a phalanx checkpoint of ``step`` in ``dst``
    (its model section: ``load(dst, model=..., rng=False)`` restores it at any world size;
    its rank file holds the converting process's random generators).

    Raises:
        CheckpointError: naming the file, for a missing, crafted or inconsistent index or
            safetensors file.
    """
    single_process("from_hf")
    directory = source_dir(src, "from_hf")
    target_dir(dst, "from_hf")
    step = check_int("step", step, min=0, where="from_hf")
    state: dict[str, Any] = {}
    for name, keys in _weight_map(directory).items():
        part = _read_file(directory / name, keys)
        if state.keys() & part.keys():
            raise CheckpointError(f"{directory / name}: repeats {sorted(state.keys() & part)[:5]}")
        state.update(part)
    return write_state(dst, step, {"model": state}, {})
