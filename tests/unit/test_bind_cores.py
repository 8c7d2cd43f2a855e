"""``phalanx run --bind-cores``: the plan of each worker's cores, and the flag's checks."""

from __future__ import annotations

import pytest

from phalanx.launch.args import ArgsError, parse_args
from phalanx.launch.cores import core_blocks, describe


@pytest.mark.parametrize(
    ("cores", "nproc", "blocks"),
    [
        ([0, 1], 2, [[0], [1]]),
        (list(range(8)), 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (list(range(8)), 3, [[0, 1, 2], [3, 4, 5], [6, 7]]),  # the remainder to the first
        ([3, 1, 5, 7], 2, [[1, 3], [5, 7]]),  # the affinity mask's cores, in order
        ([0, 1], 3, [[0], [1], [0]]),  # fewer cores than workers: shared round robin
        ([4], 1, [[4]]),
    ],
)
def test_the_cores_split_into_one_block_per_worker(
    cores: list[int], nproc: int, blocks: list[list[int]]
) -> None:
    assert core_blocks(cores, nproc) == blocks


def test_the_plan_is_said_in_one_line_and_nonsense_is_refused() -> None:
    assert (
        describe([[0, 1, 2], [3], [5, 7]])
        == "local rank 0 on cores 0-2, 1 on core 3, 2 on cores 5,7"
    )
    with pytest.raises(ValueError, match="at least one worker per node, got 0"):
        core_blocks([0, 1], 0)
    with pytest.raises(ValueError, match="empty affinity mask"):
        core_blocks([], 2)


def test_the_flag_is_parsed_and_not_given_with_numa_binding() -> None:
    assert parse_args(["--bind-cores", "x.py"], environ={}).bind_cores
    assert not parse_args(["x.py"], environ={}).bind_cores
    assert parse_args(["x.py"], environ={"PET_BIND_CORES": "1"}).bind_cores
    with pytest.raises(ArgsError, match="--bind-cores and --numa-binding node both bind"):
        parse_args(["--bind-cores", "--numa-binding", "node", "x.py"], environ={})
