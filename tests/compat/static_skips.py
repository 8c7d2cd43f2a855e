"""Which of torch's DDP tests skip here, decided before any rank process starts.

Most tests of torch's suites skip on a machine without GPUs: a decorator such as
``skip_if_lt_x_gpu(2)`` checks ``torch.cuda.device_count()`` inside each rank and calls
``sys.exit(TEST_SKIPS["multi-gpu-2"].exit_code)``, after the ranks were forked, met at the
rendezvous and passed torch's barrier. This module runs the same checks in the driver instead: it
walks the test's wrapper chain (``__wrapped__``) from the outside in and calls each of torch's
*check-only* wrappers (listed in ``_checks``) with the wrapped test replaced by a probe. The check
itself is torch's own code, run with the rank's environment; so the outcome is the rank's:

- the wrapper exits with a skip code or raises ``unittest.SkipTest``: the test is skipped, with the
  reason the rank would report;
- the wrapper calls the probe: the check lets the test run; the walk goes on inward;
- any other wrapper (one that sets state up, like RPC's ``dist_init``) or the test body itself: the
  walk stops and the test runs on its ranks as before.

``with_dist_debug_levels`` only sets a debug level before calling the test (its first call
exits as the test exits), so the walk steps through it without calling it.
"""

from __future__ import annotations

import contextlib
import os
import types
import unittest
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["skip_reason"]


class _Reached(Exception):
    """The probe ran: the check called the test it wraps."""


def _probe(*args: object, **kwargs: object) -> None:
    raise _Reached


def _dummy() -> None:
    """A function to decorate, to learn the code object of each decorator's wrapper."""


def _checks() -> set[types.CodeType]:
    """Code of torch's wrappers that only check a condition, then skip or call the test."""
    from torch.testing._internal import common_distributed as cd

    wrappers = [
        cd.skip_if_lt_x_gpu(1)(_dummy),
        cd.nccl_skip_if_lt_x_gpu("nccl", 1)(_dummy),
        cd.require_n_gpus_for_nccl_backend(1, "nccl")(_dummy),
        cd.skip_if_no_gpu(_dummy),
        cd.skip_if_odd_worldsize(_dummy),
        cd.skip_if_small_worldsize(_dummy),
        unittest.skip("")(_dummy),
    ]
    return {w.__code__ for w in wrappers}


def _pass_throughs() -> set[types.CodeType]:
    """Code of torch's wrappers whose first act is calling the test (after setting a level)."""
    from torch.testing._internal import common_distributed as cd

    return {cd.with_dist_debug_levels(["OFF"])(_dummy).__code__}


def _with_probe(wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper`` rebuilt with the function it calls (its ``func`` cell) replaced by the probe."""
    code = wrapper.__code__
    cells = tuple(
        types.CellType(_probe) if name == "func" else cell
        for name, cell in zip(code.co_freevars, wrapper.__closure__ or ())
    )
    return types.FunctionType(code, wrapper.__globals__, code.co_name, wrapper.__defaults__, cells)


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _exit_reason(code: object) -> str | None:
    from torch.testing._internal.common_distributed import TEST_SKIPS

    return next((s.message for s in TEST_SKIPS.values() if s.exit_code == code), None)


def _check(wrapper: Callable[..., Any], instance: object) -> tuple[bool, str | None]:
    """Run one check: (whether it calls the test, the skip reason where it skips instead)."""
    try:
        _with_probe(wrapper)(instance)
    except _Reached:
        return True, None
    except unittest.SkipTest as e:
        return False, str(e)
    except SystemExit as e:
        return False, _exit_reason(e.code)
    return False, None  # it returned without calling the test: leave that to the ranks


def skip_reason(test: Callable[..., Any], instance: object, env: dict[str, str]) -> str | None:
    """The reason the ranks would give for skipping ``test``; None where it must run on them.

    ``test`` is the test method as the class holds it, ``instance`` the test case a rank builds
    (torch's checks look at it), ``env`` the variables a rank sets (``WORLD_SIZE``, ``BACKEND``).
    """
    checks, pass_throughs = _checks(), _pass_throughs()
    fn: Any = test
    with _environ(env):
        while True:
            code = getattr(fn, "__code__", None)
            if code in checks:
                calls, reason = _check(fn, instance)
                if not calls:
                    return reason
            elif code not in pass_throughs:
                return None
            fn = fn.__wrapped__
