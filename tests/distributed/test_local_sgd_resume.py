"""Exact resume of ``LocalSGD`` and ``DiLoCo``: save after every step, resume from each save.

The machinery of ``test_job_resume_every_step`` (a 2-epoch GPT with dropout and AdamW inner
steps; every checkpoint copied and resumed in the same rank processes): every resumed run must
log the uninterrupted run's losses bitwise and end with the same parameters and the same files
of its final checkpoint. Saves fall mid-window (replicas differ and must come back per rank),
right after a synchronisation, for DiLoCo before and after the outer momentum exists, and for
streaming DiLoCo with a quantised average in flight.
"""

from __future__ import annotations

from typing import Any

import pytest

import phalanx
from phalanx.testing import run_distributed
from tests.distributed.test_job_resume_every_step import _check, _every_save

CASES: dict[str, dict[str, Any]] = {
    "localsgd": {"strategy": phalanx.LocalSGD(sync_every=4)},
    "diloco": {"strategy": phalanx.DiLoCo(sync_every=2, outer_lr=0.7, outer_momentum=0.9)},
    "diloco-accum2": {
        "strategy": phalanx.DiLoCo(sync_every=2, outer_lr=0.5, outer_momentum=0.5, nesterov=False),
        "grad_accum": 2,
    },
    # A fragment launches after every step (offsets 0 and 1 of H = 2) and applies one step
    # later: every save catches an int8 average in flight.
    "streaming-int8": {
        "strategy": phalanx.StreamingDiLoCo(
            sync_every=2, fragments=2, overlap=1, quantise="int8", quantise_block=64
        )
    },
}


def _every_case(root: str) -> dict[str, dict[str, Any]]:
    return {case: _every_save(options, f"{root}/{case}") for case, options in CASES.items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("local-sgd-every-step"))
    return run_distributed(_every_case, root, world_size=2, timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_resume_from_every_step_is_bitwise_identical(
    case: str, two_ranks: list[dict[str, dict[str, Any]]]
) -> None:
    _check([by_case[case] for by_case in two_ranks], CASES[case].get("grad_accum", 1))


def test_replicas_are_saved_per_rank(two_ranks: list[dict[str, dict[str, Any]]]) -> None:
    # The final checkpoint (after step 6, no sync there for H = 4) holds each rank's replica.
    files = two_ranks[0]["localsgd"]["ref"]["files"]
    assert {"model-shard-00000.json", "model-shard-00001.json"} <= set(files)
    assert {"optimizer-shard-00000.json", "optimizer-shard-00001.json"} <= set(files)
