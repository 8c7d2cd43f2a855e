"""Parameter servers over c10d point-to-point: synchronous, asynchronous, bounded staleness.

Server ranks hold the parameters, sharded by size, and run the optimizer; workers ``pull()``
parameters, compute gradients and ``push()`` them (seed 003's master-worker ASGD, made robust).
Messages are an int64 header plus one tensor: no pickle and no torch RPC on the wire.

- :class:`ParameterServer`: this rank's role (server shard or worker) in one object.
- :mod:`.core`: the consistency rules (sync / async / ssp) as a pure state machine.
- :mod:`.protocol`, :mod:`.wire`: the header and its transport; :mod:`.shards`: the shard plan;
  :mod:`.validate`: the checks every update passes before it touches the server's state;
  :mod:`.ledger`: exactly-once and staleness bookkeeping.
"""

from __future__ import annotations

from phalanx.parameter_server.core import MODES, ServerCore, WorkerLost
from phalanx.parameter_server.ledger import Ledger, may_proceed, slowest
from phalanx.parameter_server.protocol import (
    Header,
    Kind,
    ProtocolError,
    decode_header,
    encode_header,
)
from phalanx.parameter_server.roles import ParameterServer
from phalanx.parameter_server.server import Server, ServerReport
from phalanx.parameter_server.shards import ParamSlot, ShardPlan, plan_shards
from phalanx.parameter_server.validate import MalformedUpdate, check_update
from phalanx.parameter_server.worker import ServerError, Worker, WorkerHistory

__all__ = [
    "MODES",
    "Header",
    "Kind",
    "Ledger",
    "MalformedUpdate",
    "ParamSlot",
    "ParameterServer",
    "ProtocolError",
    "Server",
    "ServerCore",
    "ServerError",
    "ServerReport",
    "ShardPlan",
    "Worker",
    "WorkerHistory",
    "WorkerLost",
    "check_update",
    "decode_header",
    "encode_header",
    "may_proceed",
    "plan_shards",
    "slowest",
]
