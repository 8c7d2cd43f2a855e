"""Pure checks of single flag values: each returns the typed value or raises ArgsError.

Every message names the flag, the value as typed and what would be accepted.
"""

from __future__ import annotations

import re
import signal

from phalanx.launch.config import DEFAULT_MASTER_PORT, ArgsError, StdSpec

__all__ = [
    "comma_list",
    "endpoint",
    "integer",
    "nnodes",
    "port",
    "rank_set",
    "rdzv_conf",
    "seconds",
    "signals",
    "std_spec",
]


def integer(flag: str, raw: str, minimum: int) -> int:
    """An integer of at least ``minimum``."""
    try:
        value = int(raw)
    except ValueError:
        raise ArgsError(f"{flag} {raw!r} is not an integer") from None
    if value < minimum:
        raise ArgsError(f"{flag} {value} is invalid: it must be at least {minimum}")
    return value


def seconds(flag: str, raw: str, allow_zero: bool = False) -> float:
    """A positive (or, with ``allow_zero``, non-negative) number of seconds."""
    try:
        value = float(raw)
    except ValueError:
        raise ArgsError(f"{flag} {raw!r} is not a number of seconds") from None
    if not (value >= 0 if allow_zero else value > 0) or value != value or value == float("inf"):
        least = "zero or more" if allow_zero else "a positive number of"
        raise ArgsError(f"{flag} {raw} is invalid: it must be {least} seconds")
    return value


def port(flag: str, raw: str) -> int:
    """A TCP port number 1..65535."""
    try:
        value = int(raw)
    except ValueError:
        raise ArgsError(f"{flag} {raw!r} is not a port number (1..65535)") from None
    if not 1 <= value <= 65535:
        raise ArgsError(f"{flag} {value} is outside the valid port range 1..65535")
    return value


def nnodes(raw: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> (min, max)."""
    if ":" not in raw:
        n = integer("--nnodes", raw, minimum=1)
        return n, n
    low, _, high = raw.partition(":")
    lo, hi = integer("--nnodes", low, 1), integer("--nnodes", high, 1)
    if lo > hi:
        raise ArgsError(f"--nnodes {raw}: MIN={lo} is larger than MAX={hi}")
    return lo, hi


def endpoint(raw: str, default_port: int = DEFAULT_MASTER_PORT) -> tuple[str, int]:
    """Split ``host:port``, ``[v6]:port`` or a bare host (default port) into host and port."""
    host, number = raw, str(default_port)
    if raw.startswith("["):
        close = raw.find("]")
        if close < 0:
            raise ArgsError(f"--rdzv-endpoint {raw!r}: missing ']' after the IPv6 address")
        host, rest = raw[1:close], raw[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ArgsError(f"--rdzv-endpoint {raw!r} is not of the form [HOST]:PORT")
            number = rest[1:]
    elif raw.count(":") == 1:
        host, number = raw.split(":")
    if not host:
        raise ArgsError(f"--rdzv-endpoint {raw!r} has no host; use HOST:PORT")
    return host, port("--rdzv-endpoint", number)


_STD_ONE = re.compile(r"^[0123]$")
_STD_MAP = re.compile(r"^(\d+:[0123],)*\d+:[0123]$")


def std_spec(flag: str, raw: str, nproc: int) -> StdSpec:
    """torchrun's ``0``..``3`` or ``local_rank:value,...`` (local ranks must exist here)."""
    if _STD_ONE.match(raw):
        return StdSpec(int(raw))
    if not _STD_MAP.match(raw):
        raise ArgsError(
            f"{flag} {raw!r} is not 0 (none), 1 (stdout), 2 (stderr), 3 (both), or "
            f"LOCAL_RANK:VALUE,... such as 0:3,1:2"
        )
    pairs = tuple((int(r), int(v)) for r, v in (item.split(":") for item in raw.split(",")))
    _check_ranks(flag, raw, [r for r, _ in pairs], nproc)
    return StdSpec(per_rank=pairs)


def rank_set(flag: str, raw: str, nproc: int) -> frozenset[int] | None:
    """A comma-separated list of local ranks (empty string: None, i.e. every rank)."""
    if not raw:
        return None
    try:
        ranks = [int(item) for item in raw.split(",")]
    except ValueError:
        raise ArgsError(
            f"{flag} {raw!r} is not a comma-separated list of local ranks, e.g. {flag}=0,1"
        ) from None
    _check_ranks(flag, raw, ranks, nproc)
    return frozenset(ranks)


def _check_ranks(flag: str, raw: str, ranks: list[int], nproc: int) -> None:
    bad = [r for r in ranks if not 0 <= r < nproc]
    if bad:
        raise ArgsError(
            f"{flag} {raw} names local rank {bad[0]}, but this node runs local ranks "
            f"0..{nproc - 1} (--nproc-per-node {nproc})"
        )


def comma_list(raw: str | list[str]) -> tuple[str, ...]:
    """torchrun's comma-separated list, where ``,,`` stands for a literal comma."""
    if isinstance(raw, list):
        return tuple(raw)
    if not raw:
        return ()
    marker = "\0"
    return tuple(item.replace(marker, ",") for item in raw.replace(",,", marker).split(","))


def signals(raw: str) -> tuple[int, ...]:
    """``SIGTERM,SIGUSR1,...`` -> signal numbers; a signal that cannot be caught is an error."""
    found = []
    for name in (item.strip() for item in raw.split(",")):
        number = getattr(signal, name, None) if name.startswith("SIG") else None
        if not isinstance(number, signal.Signals) or name.startswith("SIG_"):
            raise ArgsError(
                f"--signals-to-handle {raw!r}: {name!r} is not a signal name such as SIGTERM "
                f"or SIGUSR1"
            )
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ArgsError(f"--signals-to-handle {raw!r}: {name} cannot be caught by a process")
        found.append(int(number))
    return tuple(found)


RDZV_TIMEOUT_KEYS = ("timeout", "join_timeout")
"""torchrun's static backend reads ``timeout``, its c10d backend ``join_timeout``."""
_CHECKED_KEYS = ("rank", "is_host", "store_type")
"""Keys that only restate what phalanx does: accepted when they agree with it."""
_UNSUPPORTED_KEYS = {
    "last_call_timeout": "node 0 waits a fixed 3 s for more nodes once MIN have joined",
    "close_timeout": "there is no separate close phase",
    "heartbeat": "agents send a heartbeat every 1 s and a node is lost after 30 s of silence",
    "keep_alive_interval": "agents send a heartbeat every 1 s",
    "keep_alive_max_attempt": "a node is lost after 30 s without a heartbeat",
    "read_timeout": "store operations time out after --rdzv-timeout",
    "use_libuv": "phalanx chooses how its own store is hosted",
}


def _restates(key: str, value: str, node_rank: int | None) -> str | None:
    """Why ``key=value`` contradicts phalanx's rendezvous, or None when it agrees (a node rank
    taken at the rendezvous, None, agrees with any ``rank`` and ``is_host``)."""
    if node_rank is None and key in ("rank", "is_host"):
        return None
    if key == "rank" and value != str(node_rank):
        return f"it contradicts --node-rank {node_rank}"
    if key == "is_host" and (value.lower() in ("1", "true", "yes")) != (node_rank == 0):
        return f"node 0 hosts the store, and this is node {node_rank}"
    if key == "store_type" and value.lower() != "tcp":
        return "phalanx's store is always a TCP store"
    return None


def rdzv_conf(raw: str, node_rank: int | None) -> dict[str, str]:
    """Parse ``key=value,...`` like torchrun; return the timeout keys phalanx honours.

    Keys that restate phalanx's rendezvous (``rank``, ``is_host``, ``store_type``) are checked
    and dropped; any other key raises ArgsError naming it and why it cannot be honoured.
    """
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, _, value = (s.strip() for s in item.partition("="))
        if not key or not value:
            raise ArgsError(f"--rdzv-conf {raw!r}: {item!r} is not of the form KEY=VALUE")
        conf[key] = value
    for key, value in conf.items():
        if key in RDZV_TIMEOUT_KEYS:
            continue
        reason = _restates(key, value, node_rank) if key in _CHECKED_KEYS else None
        if key not in _CHECKED_KEYS:
            reason = _UNSUPPORTED_KEYS.get(key, "phalanx's rendezvous has no such setting")
        if reason is not None:
            keys = ", ".join((*RDZV_TIMEOUT_KEYS, *_CHECKED_KEYS))
            raise ArgsError(
                f"--rdzv-conf {key}={value} cannot be honoured: {reason}. Keys phalanx "
                f"accepts: {keys}"
            )
    return {k: v for k, v in conf.items() if k in RDZV_TIMEOUT_KEYS}
