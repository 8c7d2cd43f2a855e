"""Parse ``init_process_group``'s ``init_method`` URL, naming the URL and the part that is wrong.

``urllib`` alone gives "Port out of range 0-65535" for ``tcp://h:99999`` and ``int()`` gives
"invalid literal for int() with base 10" for ``?rank=x``, neither saying which argument; these
parse errors name ``init_method`` and show what a valid value looks like.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from phalanx._check import check_str

__all__ = ["InitMethod", "parse_init_method"]

SCHEMES = ("env", "tcp", "file")
EXAMPLES = {"env": "env://", "tcp": "tcp://HOST:PORT", "file": "file:///path/to/file"}
QUERY_KEYS = ("rank", "world_size", "use_libuv")  # use_libuv: torch's, accepted and ignored


@dataclass(frozen=True)
class InitMethod:
    """What an ``init_method`` URL says."""

    scheme: str
    """env, tcp or file."""
    host: str | None = None
    """tcp://: the store's host."""
    port: int | None = None
    """tcp://: the store's port."""
    path: str | None = None
    """file://: the shared file."""
    rank: int | None = None
    """``?rank=N``, if given."""
    world_size: int | None = None
    """``?world_size=N``, if given."""


def _error(init_method: str, problem: str, scheme: str | None = "tcp") -> ValueError:
    example = EXAMPLES.get(scheme or "") or " or ".join(EXAMPLES.values())
    return ValueError(
        f"init_process_group(init_method={init_method!r}): {problem}; expected {example}"
    )


def _query_int(init_method: str, query: dict[str, list[str]], key: str, low: int) -> int | None:
    if key not in query:
        return None
    raw = query[key][-1]
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < low:
        raise _error(init_method, f"{key}={raw!r} in the query must be an int >= {low}", None)
    return value


def _port(init_method: str, netloc: str) -> int:
    _, sep, raw = netloc.rpartition(":")
    if not sep or netloc.endswith("]"):  # no colon, or a bare IPv6 address "[::1]"
        raise _error(init_method, "no port given")
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise _error(init_method, f"port {raw!r} must be an int in 1..65535")
    return int(raw)


def parse_init_method(init_method: object) -> InitMethod:
    """Split ``init_method`` into its parts; ValueError / TypeError naming what is wrong."""
    text = check_str("init_method", init_method, where="init_process_group")
    try:
        url = urlsplit(text)
        hostname = url.hostname
    except ValueError as exc:  # e.g. an unclosed "[" of an IPv6 address
        raise _error(text, f"not a URL ({exc})", None) from None
    if url.scheme not in SCHEMES:
        raise _error(text, f"unknown scheme {url.scheme!r}", None)
    query = parse_qs(url.query, keep_blank_values=True)
    unknown = sorted(set(query) - set(QUERY_KEYS))
    if unknown:
        raise _error(text, f"unknown query parameter(s) {', '.join(unknown)}", url.scheme)
    rank = _query_int(text, query, "rank", 0)
    world_size = _query_int(text, query, "world_size", 1)
    if url.scheme == "tcp":
        port = _port(text, url.netloc)
        if not hostname:
            raise _error(text, "no host given")
        return InitMethod("tcp", hostname, port, rank=rank, world_size=world_size)
    if url.scheme == "file":
        path = url.path or url.netloc
        if not path:
            raise _error(text, "no file path given", "file")
        return InitMethod("file", path=path, rank=rank, world_size=world_size)
    return InitMethod("env", rank=rank, world_size=world_size)
