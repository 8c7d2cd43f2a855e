"""Exact resume at every step: save after every ``job.step()``, resume from each save, bitwise.

One uninterrupted run saves after every ``job.step()`` (mid-epoch, at an epoch's end, and with
``grad_accum=2`` also while a micro-step is pending) and keeps a copy of each checkpoint. Then,
in the same rank processes and process group, a fresh :class:`phalanx.Job` resumes from each
copy and trains to the end. Each resumed run must log the same losses (bitwise) for the batches
it trains and end with a checkpoint whose every file (parameters, optimizer and scheduler state,
each rank's RNG and sampler position) has the uninterrupted run's sha256, with the same
parameters in memory. The model has dropout, so a resume that restores the random generators
at the wrong moment differs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.testing import run_distributed
from tests.distributed.gpt_cases import BLOCK, VOCAB, lm_loss, params_digest, small_gpt

EPOCHS = 2
PER_RANK_BATCH = 2

CASES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "ddp-accum2": {"strategy": "ddp", "grad_accum": 2},
    "ddp-accum2-no-progress": {"strategy": "ddp", "grad_accum": 2, "_loop": "direct"},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": phalanx.Zero(stage=2)},
    "zero2-accum2": {"strategy": "zero2", "grad_accum": 2},
    "zero3": {"strategy": "zero3"},
    "zero3-accum2": {"strategy": "zero3", "grad_accum": 2},
    "pipeline-pp2": {"strategy": phalanx.Mesh(dp=1, pp=2, micro_batches=2)},
    "tensor-tp2": {"strategy": phalanx.Mesh(dp=1, tp=2)},
    "tensor-tp2-accum2": {"strategy": phalanx.Mesh(dp=1, tp=2), "grad_accum": 2},
}
MESH = {"strategy": phalanx.Mesh(dp=2, pp=2, micro_batches=2)}
"""dp=2 x pp=2 at 4 ranks."""


def _data(replicas: int) -> torch.utils.data.TensorDataset:
    # 3 batches per replica and epoch: with grad_accum=2 the last one closes a window alone.
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (3 * replicas * PER_RANK_BATCH, BLOCK), generator=g)
    return torch.utils.data.TensorDataset(x, torch.randint(0, VOCAB, x.shape, generator=g))


def _files(path: Path) -> dict[str, str]:
    """Name -> crc32c of every file of a committed checkpoint (from its verified manifest)."""
    manifest = json.loads((path / "manifest.json").read_text())
    return {name: entry["crc32c"] for name, entry in manifest["files"].items()}


def _run(options: dict[str, Any], ckpt: Path, keep: Path | None) -> dict[str, Any]:
    """Train ``EPOCHS`` epochs (resuming from ``ckpt``); with ``keep``, save after every step
    and copy each checkpoint to ``keep/<i>``; without, save once at the end."""
    options = dict(options)
    direct = options.pop("_loop", "progress") == "direct"
    torch.manual_seed(0)
    model = small_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    job = phalanx.Job(checkpoint_dir=ckpt, straggler_check_every=0, keep_last=1, **options)
    parallel = isinstance(options["strategy"], phalanx.Mesh)
    model, opt = job.setup(model, opt, sched, loss_fn=None if parallel else lm_loss)
    replicas = job.groups.topology.dp if job.groups is not None else job.world.world_size
    loader = job.loader(_data(replicas), batch_size=PER_RANK_BATCH, shuffle=True)
    losses: dict[str, float] = {}
    saves: list[dict[str, Any]] = []
    for epoch in job.epochs(EPOCHS):
        for x, y in loader if direct else job.progress(loader):
            at = f"{epoch}/{hashlib.sha256(x.numpy().tobytes()).hexdigest()[:12]}"
            losses[at] = job.log(loss=float(job.forward_backward(x, y)))["loss"]
            stepped = job.step()
            if keep is not None:
                path = job.save()  # asynchronous: the next step runs during the write
                saves.append({"at": at, "stepped": stepped, "step": job.step_count})
                if job.world.is_main:
                    phalanx.checkpoint.wait()  # committed: copy it
                    shutil.copytree(path, keep / str(len(saves) - 1) / path.name)
    final = job.save()
    phalanx.checkpoint.wait()
    files = _files(final) if job.world.is_main else {}
    out = {"losses": losses, "saves": saves, "params": params_digest(model), "files": files}
    out["step"] = job.step_count
    job.close()
    return out


def _every_save(options: dict[str, Any], root: str) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    base = Path(root)
    ref = _run(options, base / "ref", base / "saves")
    resumed = []
    for i in range(len(ref["saves"])):
        dist.barrier()  # rank 0 has copied every checkpoint
        resumed.append(_run(options, base / "saves" / str(i), None))
    return {"ref": ref, "resumed": resumed}


def _first_redone(saves: list[dict[str, Any]], i: int) -> int:
    """Index of the first batch a run resumed from save ``i`` trains: the one after the last
    optimizer step (saves are one per batch, in order; pending micro-batches are redone)."""
    return max((j + 1 for j in range(i + 1) if saves[j]["stepped"]), default=0)


def _check(results: list[dict[str, Any]], grad_accum: int) -> None:
    for rank, got in enumerate(results):
        ref = got["ref"]
        saves, order = ref["saves"], list(ref["losses"])
        assert [s["at"] for s in saves] == order  # one save per batch
        # Three batches per epoch: saves[2] and saves[5] follow the last batch of an epoch.
        assert [at.split("/")[0] for at in order] == ["0"] * 3 + ["1"] * 3
        # With accumulation, some saves were taken with a micro-step pending.
        assert all(s["stepped"] for s in saves) == (grad_accum == 1)
        assert len(got["resumed"]) == len(saves) == EPOCHS * 3
        for i, run in enumerate(got["resumed"]):
            where = f"rank {rank}, resumed from save {i} ({saves[i]})"
            # It trains exactly the batches after the save's optimizer step, none twice.
            assert list(run["losses"]) == order[_first_redone(saves, i) :], where
            for at, loss in run["losses"].items():
                assert loss == ref["losses"][at], f"{where}: loss at epoch/position {at}"
            assert run["step"] == ref["step"], where
            assert run["params"] == ref["params"], f"{where}: parameters differ"
            assert run["files"] == ref["files"], f"{where}: final checkpoint files differ"


def _every_case(root: str) -> dict[str, dict[str, Any]]:
    # One set of rank processes for every case: starting ranks costs more than a case.
    return {case: _every_save(options, f"{root}/{case}") for case, options in CASES.items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("every-step"))
    return run_distributed(_every_case, root, world_size=2, timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_resume_from_every_step_is_bitwise_identical(
    case: str, two_ranks: list[dict[str, dict[str, Any]]]
) -> None:
    _check([by_case[case] for by_case in two_ranks], CASES[case].get("grad_accum", 1))


def test_resume_from_every_step_of_a_dp_pp_mesh(tmp_path: Path) -> None:
    results = run_distributed(_every_save, MESH, str(tmp_path), world_size=4, timeout=300)
    _check(results, 1)
