"""phalanx.DataParallel on CPU device lists: the threaded scatter, replicate and gather path.

Tolerances: outputs and gradients use assert_close's float32 defaults (rtol=1.3e-6, atol=1e-5).
Replicas on the CPU run the very same parameters on slices of the batch, so outputs match the plain
module up to how the matmul kernel blocks a smaller batch, and parameter gradients are the sum of
per-slice gradients: the same terms added in a different order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from phalanx.data_parallel.dp import DataParallel

CPU2 = ["cpu", "cpu"]
CPU3 = [torch.device("cpu")] * 3


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny tensors; torch's intra-op pool only adds contention with the replica threads.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.dropout = nn.Dropout(p=0.0)  # disabled: replicas would draw different masks
        self.head = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.features(x).flatten(1)))


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _out_and_grads(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    module.zero_grad()
    y = module(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    inner = getattr(module, "module", module)  # ours or torch.nn.DataParallel
    return y.detach(), _grads(inner)


@pytest.mark.parametrize("devices", [CPU2, CPU3], ids=["2cpu", "3cpu"])
@pytest.mark.parametrize(
    ("make", "shape"), [(_mlp, (7, 6)), (SmallCNN, (5, 3, 8, 8))], ids=["mlp", "cnn"]
)
def test_output_and_gradients_match_the_plain_module(
    devices: list[Any], make: Any, shape: Any
) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    plain = make()
    want = _out_and_grads(plain, x)
    got = _out_and_grads(DataParallel(make(), device_ids=devices), x)
    torch.testing.assert_close(got, want)


def test_gradient_reaches_the_input_and_grad_mode_reaches_the_threads() -> None:
    model = _mlp()
    x = torch.randn(5, 6, requires_grad=True)
    DataParallel(model, CPU3)(x).sum().backward()
    want = torch.autograd.grad(model(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, want)
    with torch.no_grad():
        assert not DataParallel(model, CPU3)(x).requires_grad
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast is thread-local too
        assert DataParallel(model, CPU3)(x).dtype == torch.bfloat16


class Recorder(nn.Module):
    """Records what each replica received (from several threads: guarded by a lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.seen: list[tuple[str, Any]] = []
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor, *, extra: dict[str, Any], scale: float = 1.0) -> Any:
        with self.lock:
            self.seen.append((threading.current_thread().name, (x.shape[0], extra["ids"].shape[0])))
        out = self.lin(x) * scale + extra["bias"][:, None]
        return {"out": out, "pair": (out.sum(1), None), "ids": [extra["ids"]]}


def test_uneven_batch_kwargs_and_nested_outputs() -> None:
    rec = Recorder()
    x, ids, bias = torch.randn(5, 4), torch.arange(5), torch.arange(5.0)
    got = DataParallel(rec, CPU2)(x, extra={"ids": ids, "bias": bias}, scale=2.0)
    assert sorted(s for _, s in rec.seen) == [(2, 2), (3, 3)]  # 5 on 2 devices: 3 + 2
    assert len({name for name, _ in rec.seen}) == 2  # two threads
    want = rec.lin(x) * 2.0 + bias[:, None]
    torch.testing.assert_close(got["out"], want)
    torch.testing.assert_close(got["pair"][0], want.sum(1))
    assert got["pair"][1] is None
    assert torch.equal(got["ids"][0], ids)


def test_fewer_samples_than_devices_use_fewer_replicas() -> None:
    rec = Recorder()
    x, extra = torch.randn(2, 4), {"ids": torch.arange(2), "bias": torch.zeros(2)}
    out = DataParallel(rec, CPU3)(x, extra=extra)["out"]
    assert sorted(s for _, s in rec.seen) == [(1, 1), (1, 1)]
    torch.testing.assert_close(out, rec.lin(x))


def test_scalar_outputs_are_gathered_into_a_vector_with_a_warning() -> None:
    class Loss(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum()

    x = torch.arange(5.0)
    with pytest.warns(UserWarning, match="scalars"):
        out = DataParallel(Loss(), CPU2)(x)
    torch.testing.assert_close(out, torch.tensor([3.0, 7.0]))  # [0+1+2, 3+4]


def test_state_dict_keys_are_prefixed_with_module() -> None:
    model = _mlp()
    dp = DataParallel(model, CPU2)
    assert list(dp.state_dict()) == [f"module.{k}" for k in model.state_dict()]
    assert dp.module is model
    torch_dp = nn.DataParallel(_mlp())  # CPU-only torch: falls back to the plain module
    assert list(dp.state_dict()) == list(torch_dp.state_dict())


def test_training_steps_equal_training_the_plain_module() -> None:
    plain, wrapped = SmallCNN(), DataParallel(SmallCNN(), CPU3)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, wrapped)]
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        x, target = torch.randn(7, 3, 8, 8, generator=gen), torch.randint(0, 5, (7,), generator=gen)
        for model, opt in zip((plain, wrapped), opts):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), target).backward()
            opt.step()
    torch.testing.assert_close(wrapped.module.state_dict(), plain.state_dict())


def test_matches_torch_data_parallel_values() -> None:
    x = torch.randn(6, 6)
    ours, theirs = DataParallel(_mlp(), CPU2), nn.DataParallel(_mlp())
    torch.testing.assert_close(_out_and_grads(ours, x), _out_and_grads(theirs, x))


def test_replica_zero_buffers_persist_the_others_are_discarded() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    x = torch.randn(6, 3)
    DataParallel(model, CPU2)(x)
    chunk0 = model[0](x[:3]).detach()
    torch.testing.assert_close(model[1].running_mean, 0.1 * chunk0.mean(0))
    assert model[1].num_batches_tracked.item() == 1


def test_tied_weights_stay_tied_and_gradients_match() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    ids = torch.tensor([1, 2, 3, 4, 5])
    torch.testing.assert_close(
        _out_and_grads(DataParallel(model, CPU2), ids), _out_and_grads(model, ids)
    )


def test_replica_exception_is_reraised_naming_the_device() -> None:
    class FailsOnSmallChunks(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] < 3:
                raise KeyError("small chunk")
            return x

    with pytest.raises(KeyError, match=r"replica 1 on device cpu.*small chunk") as info:
        DataParallel(FailsOnSmallChunks(), CPU2)(torch.randn(5, 2))
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_ids": []}, r"device_ids=\[\]"),
        ({"device_ids": "cpu"}, "device_ids must be a list"),
        ({"device_ids": ["cpu", "gpu7"]}, r"device_ids=\['cpu', 'gpu7'\].* device_ids\[1\] must"),
        ({"device_ids": CPU2, "output_device": "nowhere"}, "output_device='nowhere'"),
        ({"device_ids": CPU2, "output_device": 1.5}, "output_device must be"),
        ({"device_ids": CPU2, "dim": "0"}, "dim must be an int"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        DataParallel(_mlp(), **kwargs)


def test_dim_out_of_range_is_named_at_forward() -> None:
    with pytest.raises(ValueError, match=r"dim=2 is out of range for inputs\[0\]\[0\] of shape"):
        DataParallel(_mlp(), CPU2, dim=2)(torch.randn(4, 6))


def test_module_on_another_device_is_refused() -> None:
    model = _mlp().to(torch.float64)
    dp = DataParallel(model, [torch.device("meta"), torch.device("meta")])
    with pytest.raises(ValueError, match=r"device_ids\[0\]=meta.*0\.weight is on cpu"):
        dp(torch.randn(4, 6))


def test_split_along_another_dim() -> None:
    model = nn.Linear(4, 2)  # (T, B, F) input split along dim 1
    x = torch.randn(3, 5, 4)
    torch.testing.assert_close(DataParallel(model, CPU2, dim=1)(x), model(x))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback needs a machine without GPUs")
def test_no_gpu_and_no_device_ids_runs_the_module_directly_with_a_warning() -> None:
    model = _mlp()
    with pytest.warns(UserWarning, match="no CUDA device"):
        dp = DataParallel(model)
    x = torch.randn(3, 6)
    assert torch.equal(dp(x), model(x)) and dp.device_ids == []
