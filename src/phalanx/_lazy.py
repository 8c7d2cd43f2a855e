"""Package attributes loaded on first use (PEP 562): what keeps ``import phalanx`` free of torch.

``phalanx``, ``phalanx.comm`` and ``phalanx.recovery`` export names from their modules, most of
which need torch; the launcher needs a few torch-free modules under them (the store protocol,
the signed values, the node claims). So these packages import nothing when they load: the first
``phalanx.all_reduce`` or ``from phalanx.comm import world`` imports the module that defines it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["exports", "from_modules"]


def from_modules(package: str, modules: Mapping[str, str]) -> dict[str, str]:
    """``{name: module}`` from ``{submodule of package: "its exported names"}``."""
    return {n: f"{package}.{m}" for m, names in modules.items() for n in names.split()}


def exports(
    package: str, names: Mapping[str, str], submodules: Collection[str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each of ``names`` comes from its module
    (``{name: module}``), each of ``submodules`` (None: any) is imported when asked for."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
            setattr(sys.modules[package], name, value)
            return value
        if submodules is None or name in submodules:
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *(submodules or ()), *names})

    return __getattr__, __dir__
