"""memory_report(): exact bytes of parameters, gradients and optimizer state, storages once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import phalanx
from phalanx.plan import MemoryReport, memory_report
from phalanx.plan.report import format_mb
from phalanx.sharding import ZeroRedundancyOptimizer


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)  # 10*7+7 + 7*3+3 = 101 parameters
    return nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))


def _step(model: nn.Module, opt: object) -> None:
    model(torch.randn(4, 10)).pow(2).mean().backward()
    opt.step()  # type: ignore[attr-defined]


def test_parameters_only_before_backward() -> None:
    assert memory_report(_mlp()) == MemoryReport(params=101 * 4, grads=0, optimizer=0)


def test_adam_step_counts_grads_moments_and_0_dim_steps() -> None:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _step(model, opt)
    report = memory_report(model, opt)
    # exp_avg + exp_avg_sq in fp32 per element, plus one 0-dim fp32 `step` per parameter tensor
    assert (report.params, report.grads, report.optimizer) == (404, 404, 8 * 101 + 4 * 4)
    assert report.total == 404 + 404 + 824
    assert report.as_dict() == {
        "params": 404,
        "grads": 404,
        "optimizer": 824,
        "activations": 0,
        "total": 1632,
    }


def test_a_batch_adds_the_activations_its_forward_holds() -> None:
    model = _mlp()
    x = torch.randn(7, 10)
    plain = memory_report(model)
    report = memory_report(model, batch=(x,), loss_fn=lambda out, _batch: out.square().sum())
    assert report.activations > 0
    assert report.total == plain.total + report.activations
    assert "activations" in str(report) and "activations" not in str(plain)


def test_plain_sgd_has_no_state() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt)
    assert memory_report(model, opt).optimizer == 0


def test_tied_weights_and_views_into_one_buffer_count_once() -> None:
    emb, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    assert memory_report(nn.ModuleList([emb, head])).params == 15 * 4
    flat = torch.zeros(20)  # two parameters viewing one 80-byte buffer, as ZeRO-1 lays them out
    model = nn.ParameterList([nn.Parameter(flat[:12].view(3, 4)), nn.Parameter(flat[12:])])
    assert memory_report(model).params == 80


def test_state_nested_in_dicts_lists_and_tuples_deduplicated() -> None:
    class Custom:
        def __init__(self) -> None:
            shared = torch.zeros(6)
            self.state = {"a": {"b": [shared, (shared[:2], torch.zeros(2, dtype=torch.float64))]}}

    assert memory_report(_mlp(), Custom()).optimizer == 6 * 4 + 2 * 8


def test_state_bytes_and_grad_bytes_hooks() -> None:
    class Sharded:
        def __init__(self) -> None:
            self.state = {"ignored": torch.zeros(1000)}

        def state_bytes(self) -> int:
            return 123

        def grad_bytes(self) -> int:
            return 7

    report = memory_report(_mlp(), Sharded())
    assert (report.optimizer, report.grads) == (123, 7)


def test_zero1_at_world_size_1_uses_its_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    with phalanx.process_group(timeout=5):
        model = _mlp()
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, parameters_as_bucket_view=True, stage=1, lr=1e-2
        )
        _step(model, opt)
        report = memory_report(model, opt)
        full_grads = sum(4 * p.numel() for p in model.parameters() if p.grad is not None)
        assert report.params == 404  # views of one flat buffer: counted once
        assert report.optimizer == opt.state_bytes() > 0
        assert report.grads == full_grads + getattr(opt, "grad_bytes", lambda: 0)()


def test_wrong_argument_types_name_the_argument_and_type() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got list"):
        memory_report([nn.Linear(2, 2)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"optimizer must be .* got str"):
        memory_report(_mlp(), "adam")

    class Bad:
        def state_bytes(self) -> float:
            return 1.5

    with pytest.raises(TypeError, match=r"optimizer.state_bytes\(\) must return an int, got float"):
        memory_report(_mlp(), Bad())


def test_frozen_and_readable() -> None:
    report = MemoryReport(params=3_272_704, grads=0, optimizer=1_234_567_890)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.params = 0  # type: ignore[misc]
    assert str(report) == "params 3.27 MB, grads 0 MB, optimizer 1230 MB, total 1240 MB"
    assert [format_mb(x) for x in (404, 12_345, 98_765_432)] == [
        "0.000404 MB",
        "0.0123 MB",
        "98.8 MB",
    ]
