"""``horovod.common.exceptions``: Horovod's error types, as phalanx raises them."""

from __future__ import annotations

from phalanx.horovod import HorovodInternalError

__all__ = ["HorovodInternalError"]
