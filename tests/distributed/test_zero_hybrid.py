"""Hybrid sharding (``phalanx.Zero(shard="host")``): shard inside a host, replicate across hosts.

Four ranks pretend to be 2 hosts x 2 ranks (``run_distributed(nodes=2)`` sets ``GROUP_RANK``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and a per-node ``PHALANX_SHM_HOST`` as a launcher would).
Every step's global batch is fixed and split evenly over the ranks, so training is the same at
any world size and layout.

Tolerance 1e-5 (relative, atol 1e-6): the hybrid gradient is a sum over the host (reduce-scatter)
then over the hosts (all-reduce) of per-rank means, equal to the one-process mean over the whole
batch, and to ZeRO-3's sum over 4 ranks, up to floating-point reassociation. Replicas (the same
shard on both hosts) are bit-identical, and a checkpoint's state loads exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.testing import run_distributed
from phalanx.train.strategies.zero import ZeroRunner
from tests.distributed.test_zero3 import OPTS, _model, _reference
from tests.distributed.test_zero3 import _batch as zero3_batch

SAVE_AT, STEPS, HOSTS_X_RANKS = 2, 4, 4
CASE = {"opt": "adamw", "steps": STEPS}  # test_zero3's model, batches and reference
RTOL, ATOL = 1e-5, 1e-6
STAGES = (3, 2)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    cls, kw = OPTS["adamw"]
    return cls(params, **kw)


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of step ``step``'s global batch (test_zero3's batches of 4 ranks)."""
    xs, ys = zip(*[zero3_batch(step, r, CASE) for r in range(HOSTS_X_RANKS)])
    per = len(xs) // world
    return torch.cat(xs[rank * per : (rank + 1) * per]), torch.cat(
        ys[rank * per : (rank + 1) * per]
    )


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (ZeRO-3 gathers them: a collective)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(strategy: phalanx.Zero, directory: str | None) -> dict[str, Any]:
    """Train to STEPS (resuming from ``directory`` if it holds a checkpoint; saving there at
    SAVE_AT); the state after resuming and at the end, the losses, the groups used."""
    world = phalanx.world()
    job = phalanx.Job(strategy=strategy, checkpoint_dir=directory, seed=0)
    net = _model(CASE)
    model, opt = job.setup(net, _optimizer(net.parameters()))
    assert opt is not None
    if directory:
        job.resume()
    out: dict[str, Any] = {"resumed_at": job.step_count, "losses": []}
    out["loaded"] = _full(model)
    runner = job.runner
    if isinstance(runner, ZeroRunner):
        groups = runner.hybrid
        out["shard"] = dist.get_process_group_ranks(groups.shard)
        out["replicate"] = groups.replicate and dist.get_process_group_ranks(groups.replicate)
        out["backends"] = (groups.shard_backend, groups.replicate_backend)
    while job.step_count < STEPS:
        x, y = _batch(job.step_count, world.rank, world.world_size)
        loss = torch.nn.functional.mse_loss(model(x), y)
        job.backward(loss)
        avg = loss.detach().clone()
        phalanx.all_reduce(avg, phalanx.ReduceOp.AVG)
        out["losses"].append(float(avg))
        job.step()
        if job.step_count == SAVE_AT and directory and not out["resumed_at"]:
            job.save()
            out["saved"] = _full(model)
    out["final"] = _full(model)
    job.close()
    return out


def _hybrid_and_plain(directory: str) -> dict[str, Any]:
    """At 2 hosts x 2 ranks: hybrid ZeRO-3 and ZeRO-2 (each saving a checkpoint), plain ZeRO-3."""
    out = {
        f"hybrid{s}": _train(phalanx.Zero(stage=s, shard="host"), f"{directory}/zero{s}")
        for s in STAGES
    }
    out["plain3"] = _train(phalanx.Zero(stage=3), None)
    return out


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("hybrid")
    results = run_distributed(_hybrid_and_plain, str(directory), world_size=4, nodes=2, timeout=240)
    return directory, results


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL, msg=key)


def test_hybrid_matches_one_process_and_zero3_over_every_rank(
    two_by_two: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = two_by_two
    ref = _reference(CASE, HOSTS_X_RANKS)
    for rank, res in enumerate(results):
        for s in STAGES:
            hybrid = res[f"hybrid{s}"]
            host = rank // 2
            assert hybrid["shard"] == [2 * host, 2 * host + 1]  # the ranks of its host
            assert hybrid["replicate"] == [rank % 2, rank % 2 + 2]  # its peer on the other host
            assert hybrid["backends"] == ("shm", "gloo")
            _close(hybrid["final"], ref["state"])
            _close(hybrid["final"], res["plain3"]["final"])
            torch.testing.assert_close(hybrid["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
            for key, value in hybrid["final"].items():  # replicas and shards agree exactly
                assert torch.equal(value, results[0][f"hybrid{s}"]["final"][key]), key
        _close(res["plain3"]["final"], ref["state"])


def test_hybrid_checkpoint_holds_one_copy_of_the_shards(
    two_by_two: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, _ = two_by_two
    saved = directory / "zero3" / f"step-{SAVE_AT:06d}"
    sizes = {
        rank: sum(f.stat().st_size for f in saved.glob(f"*-shard-{rank:05d}*.safetensors"))
        for rank in range(4)
    }
    assert sizes[0] > 1000 and sizes[1] > 1000, sizes  # host 0 writes the pieces
    assert sizes[2] < sizes[0] / 10 and sizes[3] < sizes[1] / 10, sizes  # host 1: none


def _resume(directory: str, shard: str) -> dict[str, Any]:
    return {
        f"zero{s}": _train(phalanx.Zero(stage=s, shard=shard), f"{directory}/zero{s}")
        for s in STAGES
    }


@pytest.mark.parametrize(
    ("world_size", "nodes", "shard"),
    [(4, 1, "host"), (4, 4, "host"), (2, 1, "host"), (2, 1, "world")],
    ids=["1x4", "4x1", "1x2", "zero-1x2"],
)
def test_hybrid_checkpoint_loads_at_another_host_count(
    two_by_two: tuple[Path, list[dict[str, Any]]], world_size: int, nodes: int, shard: str
) -> None:
    directory, saved = two_by_two
    results = run_distributed(
        _resume, str(directory), shard, world_size=world_size, nodes=nodes, timeout=180
    )
    for res in results:
        for s in STAGES:
            got, before = res[f"zero{s}"], saved[0][f"hybrid{s}"]
            assert got["resumed_at"] == SAVE_AT
            for key, value in before["saved"].items():  # the loaded state is the saved one
                assert torch.equal(got["loaded"][key], value), key
            torch.testing.assert_close(
                got["losses"], before["losses"][SAVE_AT:], rtol=RTOL, atol=ATOL
            )
            _close(got["final"], before["final"])
