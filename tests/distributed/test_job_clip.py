"""``job.clip_grad_norm_`` on 2 gloo ranks clips like ``torch.nn.utils.clip_grad_norm_`` on one
process over the global batch: ddp (whole gradients), zero1/zero2 (optimizer ranges), zero3
(flat shards), a tensor-parallel GPT (tp=2, shards plus replicated parameters) and a pipelined
one (pp=2, each stage its own parameters), in fp32 and in ``precision="fp16-mixed"`` (CPU
autocast and torch's CPU gradient scaler), on unscaled gradients.

``max_norm`` is small enough that every step clips. The one-process reference runs each rank's
half-batch as a micro-batch (loss halved, gradients accumulated): in fp16 the rounding of each
half's fp16 backward is then the one a rank does, and the halving, the scale and the unscaling
are powers of two (exact). Tolerance: float32 reassociation of the norm's partial sums over the
shards (the same as the strategies' parity tests).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.models import GPT, GPTConfig
from phalanx.testing import run_distributed

STEPS, PER_RANK, MAX_NORM, SCALE = 3, 2, 0.05, 2.0**10


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _mlp_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    n = STEPS * 2 * PER_RANK
    return torch.utils.data.TensorDataset(
        torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g)
    )


def _halves(step: int) -> list[list[int]]:
    """The samples each of the 2 ranks reads at ``step`` (the job's sampler, unshuffled)."""
    data = _mlp_data()
    ranks = [list(phalanx.DistributedSampler(data, 2, r, shuffle=False)) for r in range(2)]
    return [idx[step * PER_RANK : (step + 1) * PER_RANK] for idx in ranks]


def _mlp_reference(norm_type: float, fp16: bool) -> dict[str, Any]:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _mlp_data().tensors
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        for half in _halves(step):
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                out = model(x[half])
            scale = SCALE if fp16 else 1.0
            (nn.functional.mse_loss(out, y[half]) * (scale / 2)).backward()
        for p in model.parameters():
            assert p.grad is not None
            p.grad.div_(scale)  # a power of two: exact
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)))
        opt.step()
    return {"norms": norms, "params": [p.detach().clone() for p in model.parameters()]}


def _mlp_job(strategy: str, fp16: bool, norm_type: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = _mlp()
    job = phalanx.Job(strategy, precision="fp16-mixed" if fp16 else "fp32")
    if fp16:  # the loss is scaled, the clip must see unscaled gradients
        job.precision.configure_scaler(init_scale=SCALE)
    model, _ = job.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    norms = []
    for x, y in job.progress(job.loader(_mlp_data(), batch_size=PER_RANK, shuffle=False)):
        job.backward(nn.functional.mse_loss(model(x), y))
        norms.append(float(job.clip_grad_norm_(MAX_NORM, norm_type)))
        assert job.step()
    if strategy == "zero3":
        state = model.full_state_dict(rank0_only=False)  # type: ignore[operator]
        params = [state[k] for k in ("0.weight", "0.bias", "2.weight", "2.bias")]
    else:  # torch FSDP's parameters are DTensors: made whole
        params = [_whole(p.detach()).clone() for p in model.parameters()]
    scale = None if job.precision.scaler is None else job.precision.scaler.get_scale()
    job.close()
    return {"norms": norms, "params": params, "scale": scale}


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


MLP_CASES = [
    ("ddp", False, 2.0),
    ("zero1", False, 2.0),
    ("zero2", False, 2.0),
    ("zero2", False, float("inf")),
    ("zero3", False, 2.0),
    ("zero3", False, 1.0),
    ("ddp", True, 2.0),
    ("zero1", True, 2.0),
    ("zero2", True, 2.0),
    ("zero3", True, 2.0),
    ("torch-zero1", False, 2.0),
    ("torch-fsdp", False, 2.0),
]


@pytest.mark.parametrize(("strategy", "fp16", "norm_type"), MLP_CASES)
def test_clip_matches_one_process(strategy: str, fp16: bool, norm_type: float) -> None:
    results = run_distributed(_mlp_job, strategy, fp16, norm_type, world_size=2, timeout=90)
    ref = _mlp_reference(norm_type, fp16)
    assert ref["norms"][0] > MAX_NORM  # the reference clips: the test sees clipping
    for got in results:
        assert got["scale"] == (SCALE if fp16 else None)  # no inf/nan skipped a step
        # the norm of the unscaled gradient (fp16: 1024x smaller than the scaled one's)
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        for p, want in zip(got["params"], ref["params"], strict=True):
            torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6)


def _gpt_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 65, (STEPS * PER_RANK, 16), generator=g)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 65, x.shape, generator=g))


def _gpt_job(options: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(65, 16, 2, 4, 32))
    ref = copy.deepcopy(model)
    job = phalanx.Job(phalanx.Mesh(**options))
    job.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    norms, losses = [], []
    for x, y in job.progress(job.loader(_gpt_data(), batch_size=PER_RANK, shuffle=False)):
        losses.append(float(job.forward_backward(x, y)))
        norms.append(float(job.clip_grad_norm_(MAX_NORM)))
        job.step()
    job.close()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_norms, ref_losses = [], []
    for x, y in torch.utils.data.DataLoader(_gpt_data(), batch_size=PER_RANK):
        ref_opt.zero_grad()
        loss = ref(x, y)[1]
        assert loss is not None
        loss.backward()
        ref_norms.append(float(nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        ref_opt.step()
        ref_losses.append(float(loss))
    return {"norms": norms, "losses": losses, "ref_norms": ref_norms, "ref_losses": ref_losses}


@pytest.mark.parametrize(
    "options", [{"tp": 2}, {"pp": 2, "micro_batches": 2}], ids=["tensor-tp2", "pipeline-pp2"]
)
def test_clip_with_a_split_model_matches_one_process(options: dict[str, Any]) -> None:
    for got in run_distributed(_gpt_job, options, world_size=2, timeout=90):
        assert got["ref_norms"][0] > MAX_NORM
        assert got["norms"] == pytest.approx(got["ref_norms"], rel=1e-4)
        assert got["losses"] == pytest.approx(got["ref_losses"], rel=1e-5)  # clipped steps alike
