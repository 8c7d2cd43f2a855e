"""Per-rank random number generator state: torch (CPU and CUDA), numpy and Python ``random``.

Each rank draws different random numbers (dropout masks, augmentation), so each rank saves its
own generators. torch's states are byte tensors (they go to the rank's safetensors file);
Python's and numpy's Mersenne Twister states are lists of integers (JSON).
CUDA generators are saved only when CUDA is already initialised (saving must not start CUDA).

:func:`snapshot` and :func:`apply` copy the same states without converting them (cheap enough to
take at every optimizer step: the job's resume point does); :func:`capture` turns a snapshot
into what a checkpoint stores.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["Snapshot", "apply", "capture", "restore", "snapshot"]


@dataclass(frozen=True)
class Snapshot:
    """This process's generator states as their libraries return them (no conversion)."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch_cpu: torch.Tensor
    torch_cuda: tuple[torch.Tensor, ...]


def snapshot() -> Snapshot:
    """Copy this process's generator states, unconverted (~0.1 ms on a 2-core CPU machine,
    mostly numpy's)."""
    cuda: tuple[torch.Tensor, ...] = ()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = tuple(torch.cuda.get_rng_state_all())
    numpy = np.random.get_state(legacy=True)
    assert isinstance(numpy, tuple)  # legacy=True: MT19937's (name, keys, pos, gauss, cached)
    return Snapshot(random.getstate(), numpy, torch.get_rng_state(), cuda)


def apply(state: Snapshot) -> None:
    """Set this process's generators back to ``state`` (taken by :func:`snapshot` here)."""
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.torch_cpu)
    for i, cuda in enumerate(state.torch_cuda):
        torch.cuda.set_rng_state(cuda, i)


def _numpy_state(state: tuple[Any, ...]) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = state
    return {
        "name": str(name),
        "keys": [int(k) for k in keys],
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def capture(state: Snapshot | None = None) -> dict[str, Any]:
    """``state`` (default: this process's generators now) as plain data and torch's state
    tensors, as checkpoints store it."""
    state = snapshot() if state is None else state
    version, mt, gauss = state.python
    return {
        "python": {"version": version, "state": list(mt), "gauss_next": gauss},
        "numpy": _numpy_state(state.numpy),
        "torch_cpu": state.torch_cpu,
        "torch_cuda": list(state.torch_cuda),
    }


def _restore_cuda(states: list[torch.Tensor]) -> list[str]:
    saved = len(states)
    if not saved:
        return []
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(min(saved, here)):
        torch.cuda.set_rng_state(states[i], i)
    if saved != here:
        return [
            f"the checkpoint holds CUDA generator states for {saved} devices and this "
            f"process sees {here}; restored {min(saved, here)}"
        ]
    return []


def restore(doc: dict[str, Any], where: str) -> list[str]:
    """Set this process's generators from :func:`capture`'s output; return notes on gaps.

    Raises:
        ValueError: naming ``where`` when the saved state is malformed.
    """
    try:
        py, npst = doc["python"], doc["numpy"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
        keys = np.asarray(npst["keys"], dtype=np.uint32)
        np.random.set_state(
            (
                str(npst["name"]),
                keys,
                int(npst["pos"]),
                int(npst["has_gauss"]),
                float(npst["cached_gaussian"]),
            )
        )
        torch.set_rng_state(doc["torch_cpu"].clone())
        cuda = list(doc["torch_cuda"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, OverflowError) as exc:
        raise ValueError(f"{where}: malformed random generator state ({exc!r})") from None
    return _restore_cuda(cuda)
