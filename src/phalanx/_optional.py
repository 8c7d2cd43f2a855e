"""Optional features: which extra installs each, and the one check that names its pip line.

``pip install phalanx`` brings what the library needs (torch, numpy, tqdm). A feature that needs
more calls :func:`require` before doing any work, so a missing package fails at once with the
feature's name and the exact command, not a minute into a run with a bare ``ModuleNotFoundError``::

    require("bench", "phalanx bench param_server")
    # MissingExtraError: phalanx bench param_server needs scikit-learn and matplotlib, which are
    # not installed: pip install 'phalanx[bench]'

The table mirrors ``[project.optional-dependencies]`` in pyproject.toml (a test keeps them equal).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

__all__ = ["EXTRAS", "MissingExtraError", "install_line", "require"]

EXTRAS: dict[str, dict[str, str]] = {
    "examples": {"sklearn": "scikit-learn"},
    "bench": {"sklearn": "scikit-learn", "matplotlib": "matplotlib"},
    "tensorboard": {"tensorboard": "tensorboard"},
}
"""Extra -> {module it provides: distribution that pip installs}."""


class MissingExtraError(ImportError):
    """An optional feature's packages are not installed (the message has the pip line)."""


def install_line(extra: str) -> str:
    """``pip install 'phalanx[extra]'``: the command that installs ``extra``."""
    return f"pip install 'phalanx[{extra}]'"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module without a spec
        return False


def require(extra: str, feature: str, modules: Sequence[str] | None = None) -> None:
    """Raise :class:`MissingExtraError` unless the packages of ``extra`` are importable.

    Args:
        extra: The extra that installs the feature's packages ("examples", "bench", ...).
        feature: What needs them, as the user knows it (a command, a flag, an argument).
        modules: The extra's modules this feature needs (default: all of them).

    Raises:
        MissingExtraError: naming ``feature``, the missing distributions and the pip line.
        KeyError: ``extra`` or a module is not in :data:`EXTRAS` (a bug in phalanx).
    """
    provides = EXTRAS[extra]
    wanted = list(provides) if modules is None else list(modules)
    missing = [provides[m] for m in wanted if not _installed(m)]
    if missing:
        names = " and ".join(missing)
        verb = "is" if len(missing) == 1 else "are"
        raise MissingExtraError(
            f"{feature} needs {names}, which {verb} not installed: {install_line(extra)}"
        )
