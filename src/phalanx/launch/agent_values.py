"""The values of the agents' protocol (:mod:`.rendezvous`), and the checks that parse them.

Each is stored as signed JSON (:mod:`phalanx.comm.signed`); a parse function raises TypeError on
a value of the wrong shape, which the store then treats as absent.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from phalanx.comm.signed import as_record
from phalanx.launch.summary import Failure

__all__ = [
    "Claim",
    "JobConfig",
    "Joined",
    "claim",
    "count",
    "failure",
    "job_config",
    "joined",
    "members",
    "port",
]


@dataclass(frozen=True)
class JobConfig:
    """What node 0 tells every node once per job."""

    run_id: str
    max_restarts: int
    nonce: str
    """Fresh per job: the scope of every other value of the agent store."""


@dataclass(frozen=True)
class Joined:
    """A node's join record for one generation: its nproc, signed (its proof of the secret)."""

    nproc: int
    host: str
    shm: bool = True
    """The shared-memory backend can run on this node (``comm.backends.shm_unusable``)."""


@dataclass(frozen=True)
class Claim:
    """Who holds a node rank in one generation (the first valid claim wins)."""

    token: str
    host: str
    pid: int


def members(value: Any) -> list[int]:
    if not (isinstance(value, list) and all(type(n) is int for n in value)):
        raise TypeError("members are a list of node ranks")
    return value


def port(value: Any) -> int:
    if type(value) is not int or not 0 < value < 65536:
        raise TypeError(f"a port is an integer in 1..65535, got {value!r}")
    return value


def count(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"a heartbeat is an integer, got {value!r}")
    return value


job_config = partial(as_record, JobConfig)
joined = partial(as_record, Joined)
claim = partial(as_record, Claim)
failure = partial(as_record, Failure)
