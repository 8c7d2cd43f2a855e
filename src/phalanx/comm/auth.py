"""The per-job secret and the message authentication built on it (HMAC-SHA256).

``phalanx run`` generates a 256-bit secret for a single-machine job (on several machines, set
the same ``PHALANX_JOB_SECRET`` in every launcher's environment) and hands it to the workers
in their environment: never on a command line, never in a log (the launcher's dataclasses keep
it out of their ``repr``). Services that phalanx runs over c10d (the parameter server) tag
every message with an HMAC of its bytes and check the tag before they parse anything, so a
process without the secret can neither change their state nor get an answer.
"""

from __future__ import annotations

import hashlib
import hmac
import os

__all__ = ["MAC_BYTES", "SECRET_ENV", "job_secret", "keyed", "mac", "new_secret", "verify"]

SECRET_ENV = "PHALANX_JOB_SECRET"
MAC_BYTES = 32


def new_secret() -> str:
    """A fresh 256-bit secret, hex-encoded."""
    import secrets

    return secrets.token_hex(32)


def job_secret() -> bytes | None:
    """This job's secret from ``PHALANX_JOB_SECRET``, or None when the job has none."""
    raw = os.environ.get(SECRET_ENV)
    return raw.encode() if raw else None


def mac(secret: bytes, *chunks: bytes) -> bytes:
    """HMAC-SHA256 of the concatenated ``chunks``."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for chunk in chunks:
        h.update(chunk)
    return h.digest()


def keyed(secret: bytes, context: bytes) -> hmac.HMAC:
    """An HMAC-SHA256 under ``secret`` that has already absorbed ``context``.

    ``.copy()`` it for each message: the key schedule and the context are hashed once.
    """
    return hmac.new(secret, context, digestmod=hashlib.sha256)


def verify(secret: bytes, tag: bytes, *chunks: bytes) -> bool:
    """True when ``tag`` is the HMAC of ``chunks`` (constant-time comparison)."""
    return hmac.compare_digest(mac(secret, *chunks), tag)
