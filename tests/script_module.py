"""A script that is not part of a package (under ``tools/`` or ``tests/*/scripts/``), loaded as a
module so that tests can call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_script"]


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """Execute the file at ``path`` as module ``name`` (default: ``_script_<stem>``) and return it.

    The module is registered in ``sys.modules`` first: dataclasses look their module up while
    being created."""
    spec = importlib.util.spec_from_file_location(name or f"_script_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
