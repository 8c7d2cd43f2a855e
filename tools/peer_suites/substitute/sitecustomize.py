"""Substitute phalanx's classes for a peer's in every Python process of a peer test suite.

Peer suites (torch's c10d tests, ...) start their ranks as fresh interpreters, so patching the
test driver is not enough. With this directory first on ``PYTHONPATH``, every interpreter runs
this file at start-up; ``PHALANX_SUBSTITUTE="a.b.Name=phalanx.Name;..."`` then makes each
``a.b.Name`` refer to phalanx's object before any test module imports it. Without the variable
it does nothing. Used by ``tools/peer_suites/*.py``; never installed with phalanx.
"""

import importlib
import os


def _substitute(spec: str) -> None:
    for pair in filter(None, spec.split(";")):
        target, _, source = pair.partition("=")
        t_mod, _, t_name = target.strip().rpartition(".")
        s_mod, _, s_name = source.strip().rpartition(".")
        setattr(
            importlib.import_module(t_mod), t_name, getattr(importlib.import_module(s_mod), s_name)
        )


if os.environ.get("PHALANX_SUBSTITUTE"):
    _substitute(os.environ["PHALANX_SUBSTITUTE"])
