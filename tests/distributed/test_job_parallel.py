"""Job(phalanx.Mesh(pp=...) | Mesh(tp=...)) on 4 ranks trains like one process on the global batch.

dp=2 replicas each read their half of every global batch (``job.loader`` shards by replica, not
by rank: a replica's pipeline stages and tensor shards must see the same samples); the
reference steps the whole model on the union. Tolerance: float32 reassociation only (see
test_parallel_compose.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import phalanx
from phalanx.models import GPT, GPTConfig
from phalanx.testing import run_distributed

STEPS, PER_REPLICA = 3, 2


def _data(steps: int = STEPS) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 65, (steps * 2 * PER_REPLICA, 16), generator=g)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 65, x.shape, generator=g))


def _train(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(65, 16, 2, 4, 32))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    options = dict(options)
    precision = options.pop("precision", "fp32")
    job = phalanx.Job(phalanx.Mesh(**options), precision=precision)
    _, opt = job.setup(model, opt, sched)  # GPT: the default vocabulary-parallel loss
    assert opt is not None
    losses = []
    for x, y in job.progress(job.loader(_data(), batch_size=PER_REPLICA, shuffle=False)):
        loss = job.forward_backward(x, y)
        job.step()
        losses.append(float(job.log(loss=float(loss))["loss"]))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    ref_losses = []
    for x, y in torch.utils.data.DataLoader(_data(), batch_size=2 * PER_REPLICA):
        ref_opt.zero_grad()
        loss = ref(x, y)[1]
        assert loss is not None
        loss.backward()
        ref_opt.step()
        ref_sched.step()
        ref_losses.append(float(loss))
    groups = job.groups
    assert groups is not None
    out = {
        "losses": losses,
        "ref": ref_losses,
        "dp": groups.topology.dp,
        "lr": opt.param_groups[0]["lr"],
    }
    job.close()
    return out


def _both() -> list[dict[str, Any]]:
    return [
        _train("pipeline", {"pp": 2, "micro_batches": 2, "schedule": "1f1b"}),
        _train("tensor", {"tp": 2}),
        _train("pipeline", {"pp": 2, "micro_batches": 2, "precision": "bf16-mixed"}),
        _train("pipeline", {"pp": 2, "micro_batches": 2, "schedule": "zbh1"}),
    ]


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    return run_distributed(_both, world_size=4, timeout=120)


@pytest.mark.parametrize(
    "index", [0, 1, 2, 3], ids=["pipeline-pp2", "tensor-tp2", "pipeline-bf16-mixed", "zbh1"]
)
def test_job_split_strategies_match_one_process(results: Any, index: int) -> None:
    # bf16 autocast runs each stage's matmuls with 8 mantissa bits: ~1e-2 relative.
    rtol = 2e-2 if index == 2 else 1e-5
    for rank_results in results:
        got = rank_results[index]
        assert got["dp"] == 2
        torch.testing.assert_close(got["losses"], got["ref"], rtol=rtol, atol=1e-6)
        if index == 2:  # and autocast really ran: not the fp32 numbers
            assert max(abs(a - b) for a, b in zip(got["losses"], got["ref"])) > 1e-5
        assert got["lr"] == pytest.approx(0.5 * 0.5**STEPS)  # the scheduler drives the rebuild


def _batch(step: int, replica: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _data(4).tensors
    rows = slice(step * 2 * PER_REPLICA, (step + 1) * 2 * PER_REPLICA)
    x, y = x[rows], y[rows]
    if replica is None:
        return x, y
    mine = slice(replica * PER_REPLICA, (replica + 1) * PER_REPLICA)
    return x[mine], y[mine]


def _job(strategy: str, options: dict[str, Any], ckpt: str, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(65, 16, 2, 4, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    job = phalanx.Job(phalanx.Mesh(**options), checkpoint_dir=ckpt)
    return job, job.setup(model, opt)[0]


def _resume_across_layouts(ckpt: str) -> dict[str, float]:
    """Save under dp2 x pp2, resume under dp2 x tp2 and into one plain GPT."""
    torch.set_num_threads(1)
    job, _ = _job("pipeline", {"pp": 2, "micro_batches": 2}, ckpt, seed=0)
    replica = job.groups.index("dp")
    for step in range(2):
        job.forward_backward(*_batch(step, replica))
        job.step()
    job.save()
    after_save = float(job.log(loss=float(job.forward_backward(*_batch(2, replica))))["loss"])
    job.close()
    job, _ = _job("tensor", {"tp": 2}, ckpt, seed=1)  # other init: the load must overwrite it
    replica = job.groups.index("dp")  # another layout: rank -> replica differs
    job.resume()
    resumed = float(job.log(loss=float(job.forward_backward(*_batch(2, replica))))["loss"])
    job.step()  # momentum restored: the next step matches too (checked via the next loss)
    second = float(job.log(loss=float(job.forward_backward(*_batch(3, replica))))["loss"])
    job.close()
    plain = GPT(GPTConfig(65, 16, 2, 4, 32))
    phalanx.checkpoint.load(ckpt, model=plain, rng=False)
    whole = plain(*_batch(2, None))[1]
    assert whole is not None
    return {"after_save": after_save, "resumed": resumed, "plain": float(whole), "second": second}


def _uninterrupted() -> float:
    torch.manual_seed(0)
    model = GPT(GPTConfig(65, 16, 2, 4, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(4):
        opt.zero_grad()
        loss = model(*_batch(step, None))[1]
        assert loss is not None
        if step == 3:
            return float(loss.detach())
        loss.backward()
        opt.step()
    raise AssertionError("unreachable")


def test_checkpoint_saved_pipelined_resumes_tensor_parallel_and_plain(tmp_path: Any) -> None:
    results = run_distributed(_resume_across_layouts, str(tmp_path), world_size=4, timeout=120)
    for got in results:  # reassociation only: rtol 1e-5
        assert got["resumed"] == pytest.approx(got["after_save"], rel=1e-5)
        assert got["plain"] == pytest.approx(got["after_save"], rel=1e-5)
        assert got["second"] == pytest.approx(_uninterrupted(), rel=1e-5)
    assert len(list(tmp_path.glob("*/model-shard-*.safetensors"))) >= 2  # no gather to rank 0
