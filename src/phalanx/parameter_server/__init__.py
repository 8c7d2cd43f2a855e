"""Parameter server foundations (issue 7): wire header, shard plan, update checks, ledger.

These are the pure pieces a parameter server over c10d point-to-point stands on: the int64
message header (no pickle, no torch RPC on the wire), the plan assigning parameters to servers,
the check a server runs on each PUSH before applying it, and the exactly-once / staleness / SSP
bookkeeping. The server and worker loops (synchronous, asynchronous, bounded staleness) are not
built yet.
"""

from __future__ import annotations

from phalanx.parameter_server.ledger import Ledger, may_proceed, slowest
from phalanx.parameter_server.protocol import (
    Header,
    Kind,
    ProtocolError,
    decode_header,
    encode_header,
)
from phalanx.parameter_server.shards import ParamSlot, ShardPlan, plan_shards
from phalanx.parameter_server.validate import MalformedUpdate, check_update

__all__ = [
    "Header",
    "Kind",
    "Ledger",
    "MalformedUpdate",
    "ParamSlot",
    "ProtocolError",
    "ShardPlan",
    "check_update",
    "decode_header",
    "encode_header",
    "may_proceed",
    "plan_shards",
    "slowest",
]
