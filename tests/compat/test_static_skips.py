"""``static_skips``: torch's skip checks, run in the driver, decide exactly as on the ranks."""

from __future__ import annotations

import os
import unittest
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.compat.static_skips import skip_reason

pytest.importorskip("expecttest", reason="torch's test modules need expecttest (dev extra)")
if torch.cuda.is_available():
    pytest.skip("these cases expect a machine without CUDA", allow_module_level=True)

from torch.testing._internal import common_distributed as cd

ENV = {"WORLD_SIZE": "2", "BACKEND": "gloo"}
ran: list[str] = []


def body(self: object) -> None:
    ran.append("body")


def _wrap_unknown(func: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: object) -> object:  # not one of torch's check-only wrappers
        return func(*args)

    wrapper.__wrapped__ = func  # type: ignore[attr-defined]
    return wrapper


@pytest.mark.parametrize(
    ("decorate", "reason"),
    [
        (cd.skip_if_lt_x_gpu(2), "Need at least 2 CUDA devices"),
        (cd.skip_if_lt_x_gpu(4), "Need at least 4 CUDA devices"),
        (cd.skip_if_no_gpu, "CUDA is not available."),
        (unittest.skip("see issue 1"), "see issue 1"),
        (
            lambda f: cd.with_dist_debug_levels(["OFF"])(cd.skip_if_lt_x_gpu(2)(f)),
            "Need at least 2 CUDA devices",
        ),
        (lambda f: cd.skip_if_odd_worldsize(unittest.skip("inner")(f)), "inner"),
    ],
)
def test_a_check_that_skips_gives_the_ranks_reason(
    decorate: Callable[..., Any], reason: str
) -> None:
    ran.clear()
    assert skip_reason(decorate(body), object(), ENV) == reason
    assert ran == []


@pytest.mark.parametrize(
    "decorate",
    [
        lambda f: f,
        cd.skip_if_lt_x_gpu(2, allow_cpu=True),
        cd.nccl_skip_if_lt_x_gpu("gloo", 2),
        cd.require_n_gpus_for_nccl_backend(2, "gloo"),
        cd.skip_if_odd_worldsize,
        lambda f: _wrap_unknown(cd.skip_if_lt_x_gpu(2)(f)),  # unknown outside: it may do anything
    ],
)
def test_a_test_that_may_run_is_left_to_the_ranks(decorate: Callable[..., Any]) -> None:
    ran.clear()
    assert skip_reason(decorate(body), object(), ENV) is None
    assert ran == []


def test_the_check_sees_the_ranks_environment_and_leaves_ours_alone() -> None:
    before = dict(os.environ)
    odd = {**ENV, "WORLD_SIZE": "3"}
    assert (
        skip_reason(cd.skip_if_odd_worldsize(body), object(), odd)
        == "Skipped due to odd world size."
    )
    assert dict(os.environ) == before


def test_a_skip_the_test_case_handles_itself_is_left_to_the_ranks() -> None:
    class HandlesSkips:
        def _handle_test_skip(self, msg: str) -> None:
            pass  # torch's wrapper then returns without exiting: not a skip we can predict

    assert skip_reason(cd.skip_if_lt_x_gpu(2)(body), HandlesSkips(), ENV) is None
