"""Per-rank random number generator state: torch (CPU and CUDA), numpy and Python ``random``.

Each rank draws different random numbers (dropout masks, augmentation), so each rank saves its
own generators. torch's states are byte tensors (they go to the rank's safetensors file);
Python's and numpy's Mersenne Twister states are lists of integers (JSON).
CUDA generators are saved only when CUDA is already initialised (saving must not start CUDA).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture", "restore"]


def _numpy_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "name": str(name),
        "keys": [int(k) for k in keys],
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def capture() -> dict[str, Any]:
    """This process's generator states (plain data and torch's state tensors)."""
    version, state, gauss = random.getstate()
    cuda: list[torch.Tensor] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = list(torch.cuda.get_rng_state_all())
    return {
        "python": {"version": version, "state": list(state), "gauss_next": gauss},
        "numpy": _numpy_state(),
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": cuda,
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
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise ValueError(f"{where}: malformed random generator state ({exc!r})") from None
    return _restore_cuda(cuda)
