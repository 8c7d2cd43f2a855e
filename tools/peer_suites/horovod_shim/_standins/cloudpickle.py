"""Stand-in for ``cloudpickle``, imported (not used) by the helpers of Horovod's torch tests."""

from __future__ import annotations

from typing import Any


def dumps(obj: Any) -> bytes:
    """Refuse: the torch tests never spawn helper processes through cloudpickle."""
    raise NotImplementedError("cloudpickle is not available in the peer-suite runner")


def loads(data: bytes) -> Any:
    """Refuse, as :func:`dumps` does."""
    raise NotImplementedError("cloudpickle is not available in the peer-suite runner")
