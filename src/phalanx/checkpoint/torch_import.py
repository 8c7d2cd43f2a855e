"""Import a state dict saved with ``torch.save``, without running code from the file.

``torch.load`` unpickles; a crafted file runs arbitrary code unless torch's restricted
unpickler is used (``weights_only=True``). The environment variable
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` flips torch's *default* to the unsafe unpickler, but in
torch 2.4-2.13 it does not override an explicit ``weights_only=True`` (checked in
``torch/serialization.py``: it only applies when the call site left ``weights_only`` unset). So
phalanx always passes ``weights_only=True`` explicitly, and the tests check a malicious pickle
with the variable set.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from phalanx.checkpoint.errors import CheckpointError
from phalanx.checkpoint.limits import open_regular

__all__ = ["import_torch_state_dict"]


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:300]


def _pick(obj: Any, key: str | None, file: str) -> Any:
    if key is None:
        return obj
    if not isinstance(obj, dict) or key not in obj:
        keys = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise KeyError(f"{file}: no entry {key!r} at the top level (found {keys})")
    return obj[key]


def import_torch_state_dict(
    file: str | os.PathLike[str], *, key: str | None = None
) -> dict[str, torch.Tensor]:
    """Load a ``torch.save``'d state dict (name -> tensor) safely, onto the CPU.

    Args:
        file: A file written by ``torch.save(model.state_dict(), file)``.
        key: For files holding more than a state dict (``{"model": state_dict, ...}``), the
            top-level entry to take.

    Returns:
        The state dict, ready for ``model.load_state_dict`` or :func:`phalanx.checkpoint.save`.

    Raises:
        pickle.UnpicklingError: when the file holds anything but tensors and plain containers
            (such as a pickle that would run code); nothing from it is executed.
        CheckpointError: naming the file when it is not a regular file or not a readable
            ``torch.save`` file (truncated, corrupt).
        TypeError: naming the entry that is not a tensor.
    """
    name = os.fspath(file)
    with open_regular(name) as f:  # a FIFO or device is refused, not waited on
        try:
            obj = torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise pickle.UnpicklingError(
                f"{name}: refused to unpickle it: it holds objects other than tensors and "
                f"plain containers, which could run code ({_first_line(exc)})"
            ) from None
        except Exception as exc:  # torch raises RuntimeError, EOFError, ... with C++ frames
            raise CheckpointError(
                f"{name}: not a readable torch.save file (truncated or corrupt?): "
                f"{type(exc).__name__}: {_first_line(exc)}"
            ) from None
    state = _pick(obj, key, name)
    if not isinstance(state, dict):
        raise TypeError(
            f"{name}: holds a {type(state).__name__}, not a state dict; pass key= to pick an entry"
        )
    for k, v in state.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise TypeError(
                f"{name}: entry {k!r} is a {type(v).__name__}, not a tensor; a "
                f"state dict maps names to tensors (pass key= to pick one)"
            )
    return dict(state)
