"""The environment flags of collective tracking, read once, before the process group exists.

``init_process_group`` reads them (:func:`tracking_flags`) before it opens a socket, so a
malformed value is refused at once, on every world size, and never leaves a half-made group
behind. Boolean flags share one parser (:func:`env_flag`): ``1/0``, ``true/false``,
``yes/no``, ``on/off`` in any case; unset or empty means the default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["TrackingFlags", "env_flag", "hang_timeout", "sites_compared", "tracking_flags"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
DEFAULT_HANG_TIMEOUT_S = 60.0


def env_flag(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """The boolean environment variable ``name`` (``default`` when unset or empty).

    Raises:
        ValueError: naming the variable and its value as typed.
    """
    raw = (os.environ if env is None else env).get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(
        f"environment variable {name}={raw!r} is not a boolean: use 1/0, true/false, yes/no "
        f"or on/off, or unset it"
    )


def env_seconds(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """Seconds > 0 from environment variable ``name`` (unset or blank: ``default``); a
    malformed value is named."""
    raw = (os.environ if env is None else env).get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:  # NaN too
        raise ValueError(f"{name}={raw!r} must be > 0 seconds")
    return value


def sites_compared() -> bool:
    """``PHALANX_CALL_SITES`` (default 1): 0 turns the skipped-collective rule off (the shm
    backend's call descriptors and ``phalanx.diagnostics.pairing`` both obey it)."""
    return env_flag("PHALANX_CALL_SITES", True)


def hang_timeout(env: Mapping[str, str] | None = None) -> float:
    """``PHALANX_HANG_TIMEOUT`` seconds (default 60); a malformed value is named."""
    return env_seconds("PHALANX_HANG_TIMEOUT", DEFAULT_HANG_TIMEOUT_S, env)


@dataclass(frozen=True)
class TrackingFlags:
    """What the environment asks of collective tracking."""

    check: bool = True
    """``PHALANX_MISMATCH_CHECK``: the always-on mismatch check (CRCs, comparison) runs."""
    sites: bool = True
    """``PHALANX_CALL_SITES``: call sites take part in pairing (the skipped-collective rule)."""
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    """``PHALANX_HANG_TIMEOUT``: seconds a collective may wait before a hang report."""
    debug: bool = False
    """``PHALANX_DEBUG``: validate every collective before it runs (``validate=`` overrides)."""


def tracking_flags(env: Mapping[str, str] | None = None) -> TrackingFlags:
    """Read every flag of :class:`TrackingFlags`; the first malformed one is named."""
    return TrackingFlags(
        check=env_flag("PHALANX_MISMATCH_CHECK", True, env),
        sites=env_flag("PHALANX_CALL_SITES", True, env),
        hang_timeout_s=hang_timeout(env),
        debug=env_flag("PHALANX_DEBUG", False, env),
    )
