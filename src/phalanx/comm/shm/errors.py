"""The errors of a failed shared-memory collective: torch's ``DistBackendError``, as gloo's.

They are backend errors (a peer died, timed out, or gave up), so phalanx's collectives turn
them into a :class:`phalanx.CollectiveError` with the blame of the others' progress (which
ranks never reached the call, what they were doing), exactly as they do gloo's. A call that
differs between ranks raises phalanx's ``CollectiveMismatchError`` directly instead: its
message already names both calls.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["PeerDiedError", "ShmError", "ShmTimeoutError"]


class ShmError(dist.DistBackendError):
    """A shared-memory collective failed; the group cannot continue."""


class PeerDiedError(ShmError):
    """A rank of the group died while the others waited for it."""


class ShmTimeoutError(ShmError):
    """Ranks did not arrive within the group's timeout (or the call's own, where it set one)."""
