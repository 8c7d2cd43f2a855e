"""phalanx's backend for ``torch.distributed``: ``"shm"``, registered when torch.distributed loads.

``import phalanx`` imports no torch (``phalanx run``'s agents never do), yet after it
``torch.distributed.init_process_group("shm")`` must work. So the registration waits for
torch.distributed: at once when it is loaded already, else a ``sys.meta_path`` entry registers
the backend right after torch.distributed's module has run, whoever imported it. The backend's
code (:mod:`phalanx.comm.shm`) loads when its first group is made.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from collections.abc import Sequence
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

    import torch.distributed as dist

from phalanx.comm.backends import SHM as BACKEND

__all__ = ["register", "register_when_loaded"]

log = logging.getLogger(__name__)


def register() -> None:
    """Register ``"shm"`` with ``torch.distributed.Backend`` (once; later calls do nothing)."""
    import torch.distributed as dist

    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


def _create(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    from phalanx.comm.shm import create_group

    return create_group(store, rank, world_size, timeout)


def register_when_loaded() -> None:
    """:func:`register` now if torch.distributed is loaded, else as soon as it is."""
    if "torch.distributed" in sys.modules:
        register()
    elif not any(isinstance(finder, _AfterTorchDistributed) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchDistributed())


class _AfterTorchDistributed(importlib.abc.MetaPathFinder):
    """Finds torch.distributed with the other finders and registers the backend once it ran."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)  # once, and not while the others look
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfter(spec.loader)
                return spec
        return None


class _RegisterAfter(importlib.abc.Loader):
    """torch.distributed's own loader, then :func:`register`; the module keeps the former."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        try:
            register()
        except Exception as exc:  # never break torch's own import
            log.warning("could not register phalanx's %r backend with torch: %s", BACKEND, exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
