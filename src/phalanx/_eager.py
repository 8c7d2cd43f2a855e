"""``eager``: ``torch.compiler.disable`` without importing ``torch._dynamo`` until first called.

``torch.compiler.disable`` imports dynamo (about 0.8 s of CPU) when it decorates, so a class
body using it makes every process that imports the class pay that, compiled or not. This
wrapper defers it to the first call made once dynamo is loaded (``torch.compile`` loads it):
before that nothing can be compiling, and ``fn`` runs as it is.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = ["eager"]

P = ParamSpec("P")
T = TypeVar("T")


def eager(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn`` run eagerly under ``torch.compile`` (a graph break around it)."""
    disabled: list[Callable[P, T]] = []

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        if "torch._dynamo" not in sys.modules:  # nothing compiles in this process
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return run
