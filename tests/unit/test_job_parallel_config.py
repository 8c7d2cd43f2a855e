"""Job's dp/pp/tp options: which strategy takes them, defaults, and errors naming the values."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.mesh import Topology
from phalanx.train.parallel_strategies import parallel_config

BASE: dict[str, Any] = dict(
    dp=None, pp=None, tp=None, micro_batches=1, schedule="1f1b", chunks=1, balance=None,
    tp_plan=None,
)  # fmt: skip


def config(strategy: str, world_size: int, **kw: Any) -> Any:
    return parallel_config(strategy, world_size, **{**BASE, **kw})


def test_the_strategys_own_degree_takes_the_ranks_the_others_leave() -> None:
    assert config("pipeline", 4).topology(4) == Topology(dp=1, pp=4, tp=1)
    assert config("pipeline", 4, dp=2).topology(4) == Topology(dp=2, pp=2, tp=1)
    assert config("tensor", 4, dp=2).topology(4) == Topology(dp=2, pp=1, tp=2)
    assert config("pipeline", 8, pp=2, tp=2).topology(8) == Topology(dp=2, pp=2, tp=2)
    assert config("ddp", 4) is None


def test_bad_combinations_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"pp=2 need strategy='pipeline' or 'tensor'.*'ddp'"):
        config("ddp", 4, pp=2)
    with pytest.raises(ValueError, match=r"micro_batches=4 need strategy="):
        config("zero2", 4, micro_batches=4)
    with pytest.raises(ValueError, match=r"dp=3 x pp=2 x tp=1 = 6 .* world_size=4"):
        config("pipeline", 4, dp=3, pp=2)
    with pytest.raises(ValueError, match=r"micro_batches=4 and chunks=1 apply to a pipeline"):
        config("tensor", 2, micro_batches=4)
