"""ZeRO-3 (FullyShardedDataParallel): parity with one process, 1/N memory, 3Ψ traffic, state.

Tolerances: the ranks' gradient shards are reduce-scattered sums of per-rank means, equal to the
reference's mean over the concatenated batch up to floating-point reassociation (1e-5 relative).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.comm import comm_stats, reset_comm_stats
from phalanx.sharding.pieces import Piece, PieceReader, dtype_name
from phalanx.sharding.zero3 import FullyShardedDataParallel
from phalanx.testing import run_distributed

PER_RANK = 4
OPTS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 7)  # 49 + 48 = 97 parameters per block
        self.b = nn.Linear(7, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class _Net(nn.Module):
    """Root 36 + 21 = 57 parameters, two 97-parameter blocks: 251 (odd, and 1 mod 3)."""

    def __init__(self, tied: bool = False, skip_second: bool = False) -> None:
        super().__init__()
        width_in, width_out = (6, 6) if tied else (5, 3)
        self.first = nn.Linear(width_in, 6)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.last = nn.Linear(6, width_out)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 6))
        self.skip_second = skip_second
        if tied:  # one tie inside the root, one across the two block units
            self.last.weight = self.first.weight
            self.blocks[1].a.weight = self.blocks[0].a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x)) + self.shift
        for i, block in enumerate(self.blocks):
            if not (self.skip_second and i == 1):
                h = block(h)
        return self.last(h)


def _model(case: dict[str, Any]) -> _Net:
    torch.manual_seed(case.get("seed", 0))
    net = _Net(tied=case.get("tied", False), skip_second=case.get("skip", False))
    if case.get("freeze"):  # a frozen unit: gathered for backward, never reduce-scattered
        net.blocks[0].requires_grad_(False)
    return net


def _batch(step: int, rank: int, case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    width_in, width_out = (6, 6) if case.get("tied") else (5, 3)
    return torch.randn(PER_RANK, width_in, generator=g), torch.randn(
        PER_RANK, width_out, generator=g
    )


def _wrap(case: dict[str, Any]) -> FullyShardedDataParallel:
    return FullyShardedDataParallel(
        _model(case),
        wrap=_Block,
        prefetch=case.get("prefetch", True),
        param_dtype=case.get("param_dtype"),
        reduce_dtype=case.get("reduce_dtype"),
    )


def _train(case: dict[str, Any]) -> dict[str, Any]:
    """Train ``case["steps"]`` steps (``accum`` micro-batches each, all but the last no_sync)."""
    rank = phalanx.world().rank
    model = _wrap(case)
    cls, kw = OPTS[case.get("opt", "adamw")]
    opt = cls(model.parameters(), **kw)
    losses, norms = [], []
    for step in range(case.get("steps", 5)):
        accum = case.get("accum", 1)
        for micro in range(accum):
            x, y = _batch(step * accum + micro, rank, case)
            if micro < accum - 1:
                with model.no_sync():
                    nn.functional.mse_loss(model(x), y).backward()
                assert "reduce_scatter_tensor" not in comm_stats()
            else:
                loss = nn.functional.mse_loss(model(x).float(), y)
                loss.backward()
                losses.append(loss.item())
        if "clip" in case:
            norms.append(model.clip_grad_norm_(*case["clip"]).item())
        opt.step()
        opt.zero_grad()
        reset_comm_stats()
        if case.get("eval_between"):
            with torch.no_grad():
                model(x)
    slots = [getattr(m, n) for u in model.units for e in u.entries for m, n in e.slots]
    return {
        "losses": losses,
        "norms": norms,
        "full": model.full_state_dict(rank0_only=False),
        "state_dict": model.state_dict(),
        "freed": all(t.untyped_storage().nbytes() == 0 for t in slots),
        "names": [n for n, _ in model.named_parameters()],
    }


def _reference(case: dict[str, Any], world: int) -> dict[str, Any]:
    model = _model(case)
    cls, kw = OPTS[case.get("opt", "adamw")]
    opt = cls(model.parameters(), **kw)
    losses, norms = [], []
    for step in range(case.get("steps", 5)):
        accum = case.get("accum", 1)
        for micro in range(accum):
            xs, ys = zip(*[_batch(step * accum + micro, r, case) for r in range(world)])
            loss = nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
            loss.backward()
        losses.append(loss.item())
        if "clip" in case:
            norms.append(nn.utils.clip_grad_norm_(model.parameters(), *case["clip"]).item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


def _assert_parity(case: dict[str, Any], world_size: int, rtol: float = 1e-5) -> list[Any]:
    results = run_distributed(_train, case, world_size=world_size)
    ref = _reference(case, world_size)
    for res in results:
        assert list(res["full"]) == list(ref["state"])  # the original keys, in order
        for key, want in ref["state"].items():
            torch.testing.assert_close(res["full"][key], want, rtol=rtol, atol=rtol / 10)
            assert torch.equal(res["full"][key], results[0]["full"][key])
            assert torch.equal(res["state_dict"][key], res["full"][key])
        assert res["freed"]
    mean_losses = [
        sum(r["losses"][i] for r in results) / world_size for i in range(len(ref["losses"]))
    ]
    torch.testing.assert_close(mean_losses, ref["losses"], rtol=rtol, atol=rtol / 10)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_zero3_matches_one_process(opt: str, world_size: int) -> None:
    results = _assert_parity({"opt": opt, "eval_between": True}, world_size)
    assert results[0]["names"] == [
        "module._flat_param",
        "module.blocks.0._flat_param",
        "module.blocks.1._flat_param",
    ]


def test_zero3_parity_without_prefetch() -> None:
    _assert_parity({"opt": "adamw", "prefetch": False, "steps": 3}, 2)


def test_zero3_frozen_unit() -> None:
    _assert_parity({"opt": "sgd", "freeze": True, "steps": 3}, 2)


def test_zero3_tied_weights_stay_tied() -> None:
    results = _assert_parity({"opt": "adamw", "tied": True}, 2)
    full = results[0]["full"]
    assert full["last.weight"] is full["first.weight"]
    assert full["blocks.1.a.weight"] is full["blocks.0.a.weight"]
    assert run_distributed(_tied_identity, world_size=2) == [True, True]


def _tied_identity() -> bool:
    model = _wrap({"tied": True})
    x, _ = _batch(0, phalanx.world().rank, {"tied": True})
    model(x).sum().backward()
    net = model.module
    assert isinstance(net, _Net)
    return net.last.weight is net.first.weight and net.blocks[1].a.weight is net.blocks[0].a.weight


def test_zero3_no_sync_accumulates_then_reduces_sum() -> None:
    _assert_parity({"opt": "sgd", "accum": 3, "steps": 2}, 2)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_zero3_clip_grad_norm_matches_torch(norm_type: float) -> None:
    case = {"opt": "sgd", "clip": (0.05, norm_type), "steps": 3}
    results = _assert_parity(case, 2)
    ref = _reference(case, 2)
    for res in results:
        torch.testing.assert_close(res["norms"], ref["norms"], rtol=1e-5, atol=1e-7)
        assert all(n > 0.05 for n in ref["norms"])  # the clip was active


def _memory_and_volume(case: dict[str, Any]) -> dict[str, Any]:
    model = _wrap(case)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank = phalanx.world().rank
    stats = []
    for step in range(2):
        reset_comm_stats()
        x, y = _batch(step, rank, case)
        nn.functional.mse_loss(model(x).float(), y).backward()
        stats.append(comm_stats())
        opt.step()
        opt.zero_grad(set_to_none=False)
    slots = [getattr(m, n) for u in model.units for e in u.entries for m, n in e.slots]
    state = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0
    )
    return {
        "stats": stats,
        "param_bytes": model.param_bytes(),
        "grad_bytes": model.grad_bytes(),
        "opt_bytes": state,
        "freed": all(t.untyped_storage().nbytes() == 0 for t in slots),
        "units": [(u.name, u.total, u.padded, u.chunk) for u in model.units],
        "dtypes": {p.dtype for p in model.parameters()},
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero3_memory_is_one_nth_and_traffic_is_3psi(world_size: int) -> None:
    for res in run_distributed(_memory_and_volume, {}, world_size=world_size):
        psi = sum(total for _, total, _, _ in res["units"])
        assert psi == 251
        shard = sum(chunk for *_, chunk in res["units"])
        assert shard <= psi / world_size + len(res["units"])  # < 1 element of padding per unit
        assert res["param_bytes"] == 4 * shard and res["grad_bytes"] == 4 * shard
        assert res["opt_bytes"] == 8 * shard  # AdamW exp_avg + exp_avg_sq, 1/N
        assert res["freed"]  # no full parameter storage left after the step
        padded = {name: p for name, _, p, _ in res["units"]}
        fwd, bwd = sum(padded.values()), sum(p for name, p in padded.items() if name)
        for stats in res["stats"]:
            ag_calls, ag_bytes = stats["all_gather_into_tensor"]
            rs_calls, rs_bytes = stats["reduce_scatter_tensor"]
            assert (ag_calls, rs_calls) == (2 * len(padded) - 1, len(padded))
            # Forward gathers every unit, backward every unit but the root (kept gathered).
            assert ag_bytes * world_size == 4 * (fwd + bwd)
            assert rs_bytes == 4 * fwd
            volume = (ag_bytes * world_size + rs_bytes) / 4
            assert 3 * psi - padded[""] <= volume <= 3 * (psi + world_size * len(padded))
            assert set(stats) == {"all_gather_into_tensor", "reduce_scatter_tensor"}


def test_zero3_bf16_params_fp32_reduce() -> None:
    case = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "steps": 3}
    results = run_distributed(_train, case, world_size=2)
    ref = _reference(case, 2)
    mean_losses = [sum(r["losses"][i] for r in results) / 2 for i in range(3)]
    torch.testing.assert_close(mean_losses, ref["losses"], rtol=5e-2, atol=1e-2)
    for key, want in ref["state"].items():
        assert results[0]["full"][key].dtype == torch.float32
        torch.testing.assert_close(results[0]["full"][key], want, rtol=0.1, atol=2e-2)
    res = run_distributed(_memory_and_volume, case, world_size=2)[0]
    assert res["dtypes"] == {torch.float32}  # shards, grads and optimizer state stay fp32
    padded = {name: p for name, _, p, _ in res["units"]}
    ag_bytes, rs_bytes = (
        res["stats"][0]["all_gather_into_tensor"][1],
        res["stats"][0]["reduce_scatter_tensor"][1],
    )
    assert ag_bytes * 2 == 2 * (2 * sum(padded.values()) - padded[""])  # bf16 on the wire
    assert rs_bytes == 4 * sum(padded.values())  # fp32 reduce-scatter


def _save_sharded(case: dict[str, Any], directory: str) -> dict[str, torch.Tensor]:
    model = _wrap(case)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank = phalanx.world().rank
    for step in range(2):
        x, y = _batch(step, rank, case)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model.module.shift.add_(1.0)  # type: ignore[operator]  # a buffer to round-trip
    state = model.sharded_state()
    docs = [(p.to_json(dtype_name(t.dtype)), t.clone()) for p, t in state.pieces]
    torch.save({"meta": state.meta, "pieces": docs}, os.path.join(directory, f"rank{rank}.pt"))
    return model.full_state_dict()


def _load_sharded(case: dict[str, Any], directory: str) -> dict[str, torch.Tensor]:
    model = _wrap({**case, "seed": 7})
    files = sorted(os.listdir(directory))
    loaded = {f: torch.load(os.path.join(directory, f), weights_only=True) for f in files}
    index = [
        (*Piece.from_json(doc), f, str(i))
        for f in files
        for i, (doc, _) in enumerate(loaded[f]["pieces"])
    ]
    reader = PieceReader(
        index, lambda f: {str(i): t for i, (_, t) in enumerate(loaded[f]["pieces"])}
    )
    model.load_sharded_state(loaded[files[0]]["meta"], reader)
    return model.full_state_dict()


def _load_full(case: dict[str, Any], full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model = _wrap({**case, "seed": 7})
    model.load_state_dict(full)
    x, y = _batch(9, phalanx.world().rank, case)
    nn.functional.mse_loss(model(x), y).backward()  # still trains after loading
    return model.full_state_dict()


@pytest.mark.parametrize("tied", [False, True])
def test_zero3_state_round_trips_across_world_sizes(tied: bool, tmp_path: Any) -> None:
    case = {"tied": tied}
    saved = run_distributed(_save_sharded, case, str(tmp_path), world_size=2)[0]
    assert list(saved) == list(_model(case).state_dict())
    assert torch.equal(saved["shift"], torch.linspace(-0.1, 0.1, 6) + 1.0)
    for world in (3, 1):
        loaded = run_distributed(_load_sharded, case, str(tmp_path), world_size=world)[0]
        assert list(loaded) == list(saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
    loaded = run_distributed(_load_full, case, saved, world_size=3)[0]
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


def _unused_unit() -> list[float]:
    model = _wrap({"skip": True})
    x, y = _batch(0, phalanx.world().rank, {})
    nn.functional.mse_loss(model(x), y).backward()
    grad = model.units[1].flat_param.grad
    assert grad is not None
    return grad.tolist()


def test_zero3_unit_unused_on_every_rank_gets_zero_grad() -> None:
    for grad in run_distributed(_unused_unit, world_size=2):
        assert grad and all(g == 0.0 for g in grad)


def _bad_inputs() -> list[str]:
    seen = []
    bad: list[tuple[type[Exception], dict[str, Any]]] = [
        (TypeError, {"wrap": 42}),
        (TypeError, {"wrap": (int,)}),
        (ValueError, {"param_dtype": torch.int32}),
        (TypeError, {"reduce_dtype": "bf16"}),
        (TypeError, {"prefetch": "yes"}),
    ]
    for exc, kwargs in bad:
        with pytest.raises(exc) as info:
            FullyShardedDataParallel(_model({}), **kwargs)
        seen.append(str(info.value))
    with pytest.raises(TypeError, match=r"module must be an nn\.Module"):
        FullyShardedDataParallel("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has no parameters"):
        FullyShardedDataParallel(nn.ReLU())
    model = FullyShardedDataParallel(_model({}), wrap=_Block)
    with pytest.raises(ValueError, match="already wrapped"):
        FullyShardedDataParallel(model.module)
    with pytest.raises(ValueError, match="norm_type"):
        model.clip_grad_norm_(1.0, norm_type=0.0)
    with pytest.raises(KeyError, match="missing keys"):
        model.load_full_state_dict({})
    with pytest.raises(RuntimeError, match="unexpected keys"):
        model.load_state_dict({**model.state_dict(), "bogus": torch.zeros(1)})
    return seen


def test_zero3_bad_inputs_name_the_argument_and_rank() -> None:
    messages = run_distributed(_bad_inputs, world_size=1)[0]
    for msg, word in zip(messages, ["wrap=42", "wrap=", "param_dtype", "reduce_dtype", "prefetch"]):
        assert word in msg and "[rank 0]" in msg, msg


def _two_forwards_one_backward(steps: int) -> dict[str, torch.Tensor]:
    model = _wrap({})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank = phalanx.world().rank
    for step in range(steps):
        with torch.enable_grad():
            model(_batch(99, rank, {})[0])  # output dropped, no backward: the step continues
        (x1, y1), (x2, y2) = _batch(2 * step, rank, {}), _batch(2 * step + 1, rank, {})
        loss = nn.functional.mse_loss(model(x1), y1) + nn.functional.mse_loss(model(x2), y2)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def test_zero3_two_forwards_share_one_backward() -> None:
    got = run_distributed(_two_forwards_one_backward, 3, world_size=2)[0]
    model = _model({})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        loss = sum(
            nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
            for xs, ys in (zip(*[_batch(2 * step + k, r, {}) for r in range(2)]) for k in (0, 1))
        )
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
    for key, want in model.state_dict().items():
        torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-6)


GPT_CFG = {"vocab_size": 11, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}


def _gpt_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 11, (2, 8), generator=g), torch.randint(0, 11, (2, 8), generator=g)


def _gpt_train(tie: bool, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    from phalanx.models.gpt import GPT, Block, GPTConfig

    torch.manual_seed(0)
    model = FullyShardedDataParallel(GPT(GPTConfig(**GPT_CFG, tie_weights=tie)), wrap=Block)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(steps):
        _, loss = model(*_gpt_batch(step, phalanx.world().rank))
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.full_state_dict()


@pytest.mark.parametrize("tie", [False, True])
def test_zero3_gpt_blocks_match_one_process(tie: bool) -> None:
    from phalanx.models.gpt import GPT, GPTConfig

    results = run_distributed(_gpt_train, tie, 3, world_size=2)
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**GPT_CFG, tie_weights=tie))
    # SGD, not Adam: attention's k_proj.bias has a zero gradient in exact arithmetic, and Adam
    # would blow its rounding noise up to lr-sized steps that differ between layouts.
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for step in range(3):
        idx, tgt = zip(*[_gpt_batch(step, r) for r in range(2)])
        _, loss = ref(torch.cat(idx), torch.cat(tgt))
        assert loss is not None
        loss.backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        mean = (results[0][0][step] + results[1][0][step]) / 2
        assert abs(mean - loss.item()) < 1e-5
    full = results[0][1]
    assert list(full) == list(ref.state_dict())
    for key, want in ref.state_dict().items():
        torch.testing.assert_close(full[key], want, rtol=1e-5, atol=1e-6)
