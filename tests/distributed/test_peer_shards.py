"""Peers as the checkpoint of ZeRO state: a lost rank's shards restored from a neighbour's memory.

Four ranks train a small model with Adam under ZeRO-2 or ZeRO-3 while a ShardMirror refreshes;
then rank 2 stops taking part (it is not killed: the survivors 0, 1, 3 make a new group without
it), and the survivors restore through the mirror at 3 ranks. Tolerances:

- the restored parameters and optimizer state equal, bit for bit, the 4-rank run's consolidated
  state at the snapshot step (the mirror moves raw bytes, and loading re-splits them);
- after 2 more steps on 3 ranks, the parameters equal, bit for bit, those of a 3-rank run that
  loaded the same state from a regular checkpoint (same ranks, layout and state: the same
  arithmetic); and equal a single process that loaded the consolidated state and trained on the
  whole batch within rtol 1e-5, atol 1e-6 (floating-point reassociation of the gradient mean).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.checkpoint import loading
from phalanx.recovery import RecoveryError, ShardMirror, ShardsLost, restore_shards
from phalanx.recovery.peer_shards import _gather, common_step
from phalanx.recovery.shard_snapshot import pack, readers
from phalanx.sharding import ZeroRedundancyOptimizer
from phalanx.sharding.pieces import Piece, ShardedState
from phalanx.sharding.zero3 import FullyShardedDataParallel
from phalanx.testing import run_distributed

GLOBAL_BATCH, STEPS, MORE, LR = 12, 3, 2, 1e-2


class _Net(nn.Module):
    """484 parameters (not a multiple of 3 or 4: ranges split parameters) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)) + self.shift)))


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _build(stage: int, group: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = _Net()
    if stage == 3:
        model = FullyShardedDataParallel(net, process_group=group)
        return model, torch.optim.Adam(model.parameters(), lr=LR)
    zero = ZeroRedundancyOptimizer(
        net.parameters(), torch.optim.Adam, process_group=group, stage=2, lr=LR
    )
    return net, zero


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, group: Any) -> None:
    x, y = _batch(step, dist.get_rank(group), dist.get_world_size(group))
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _full(model: nn.Module, opt: Any, stage: int, group: Any) -> dict[str, Any]:
    """Parameters, buffer and Adam state by parameter name, whole, on every rank (collective;
    through the strategies' own consolidation, independent of the mirror)."""
    if stage == 3:
        params = model.full_state_dict(rank0_only=False)
        state: dict[str, dict[str, torch.Tensor]] = {}
        for unit in model.units:
            shard_state = opt.state[unit.flat_param]
            for key, value in shard_state.items():
                whole = value.clone()  # Adam's step grows in place
                if value.dim() > 0:
                    whole = torch.empty(unit.padded, dtype=value.dtype)
                    dist.all_gather_into_tensor(whole, value.contiguous(), group=group)
                for e in unit.entries:
                    v = whole if value.dim() == 0 else whole[e.offset : e.offset + e.numel]
                    state.setdefault(e.keys[0], {})[key] = v.view(e.shape if v.dim() else ())
        return {"params": params, "optim": state}
    names = [n for n, _ in model.named_parameters()]
    full = None
    for to in range(dist.get_world_size(group)):
        opt.consolidate_state_dict(to=to)
        if dist.get_rank(group) == to:
            full = opt.state_dict()
    assert full is not None
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"params": params, "optim": {names[i]: st for i, st in full["state"].items()}}


def _single(ref: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One process: load the consolidated state, train MORE steps on the whole batch."""
    net = _Net()
    net.load_state_dict(ref["params"])
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    sd = opt.state_dict()
    names = [n for n, _ in net.named_parameters()]
    # Cloned: a loaded Adam keeps the given ``step`` tensors and increments them in place.
    sd["state"] = {
        i: {k: v.clone() for k, v in ref["optim"][n].items()} for i, n in enumerate(names)
    }
    opt.load_state_dict(sd)
    for step in range(STEPS + 1, STEPS + MORE + 1):
        x, y = _batch(step, 0, 1)
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


class _Spy:
    """Counts calls of the checkpoint loader's entry points (manifest, sharded pieces)."""

    def __init__(self) -> None:
        self.calls = 0
        for name in ("read_manifest", "read_sharded"):
            real = getattr(loading, name)
            setattr(loading, name, self._wrap(real))

    def _wrap(self, real: Any) -> Any:
        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        return spy


def _lose(
    stage: int, every: int, lost: list[int], directory: str | None, early: bool = False
) -> dict[str, Any] | None:
    """Train STEPS steps with a mirror; the ``lost`` ranks then leave (``early``: before their
    last refresh, and their process ends); the others restore through their mirrors."""
    world = dist.get_world_size()
    model, opt = _build(stage, None)
    mirror = ShardMirror(opt, model if stage == 3 else None, every=every)
    snap_step = STEPS - STEPS % every - (every if early else 0)
    ref = None
    for step in range(1, STEPS + 1):
        _step(model, opt, step, None)
        if not (early and step == STEPS and dist.get_rank() in lost):
            mirror.after_step(step)
        if step == snap_step:
            ref = _full(model, opt, stage, None)
            if directory is not None:
                phalanx.checkpoint.save(directory, step, model=model, optimizer=opt)
    failed = mirror.settle() is not None  # a survivor's job would recover on this error
    held = mirror.held_bytes()
    group = dist.new_group([r for r in range(world) if r not in lost])  # every rank calls it
    if dist.get_rank() in lost:
        return None  # stops taking part; not killed
    spy = _Spy()
    try:
        restored = restore_shards(mirror, lost, group)
    except ShardsLost as exc:
        return {"lost": str(exc)}
    new_model, new_opt = _build(stage, group)
    restored.load(new_opt, new_model if stage == 3 else None)
    out = {"step": restored.step, "held": held, "ref": ref, "calls_restore": spy.calls}
    out["exchange_failed"] = failed
    out["got"] = _full(new_model, new_opt, stage, group)
    if directory is None:
        return out
    ref_model, ref_opt = _build(stage, group)
    phalanx.checkpoint.load(directory, model=ref_model, optimizer=ref_opt, group=group, rng=False)
    out["calls_checkpoint"] = spy.calls
    for step in range(STEPS + 1, STEPS + MORE + 1):
        _step(new_model, new_opt, step, group)
        _step(ref_model, ref_opt, step, group)
    out["final"] = _full(new_model, new_opt, stage, group)["params"]
    out["final_ckpt"] = _full(ref_model, ref_opt, stage, group)["params"]
    if dist.get_rank(group) == 0:
        out["final_single"] = _single(ref)  # type: ignore[arg-type]
    return out


def _assert_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where}: differs by {(a - b).abs().max()}"
        return
    assert isinstance(a, dict) and isinstance(b, dict) and sorted(a) == sorted(b), where
    for k in a:
        _assert_equal(a[k], b[k], f"{where}.{k}")


@pytest.mark.parametrize("stage", [2, 3])
def test_restore_lost_rank_from_mirror_bit_exact(stage: int, tmp_path: Path) -> None:
    results = run_distributed(_lose, stage, 1, [2], str(tmp_path), world_size=4, timeout=90)
    assert results[2] is None
    for rank in (0, 1, 3):
        out = results[rank]
        assert out["step"] == STEPS and out["held"] > 0
        _assert_equal(out["got"], out["ref"], f"rank {rank}")
        assert out["ref"]["optim"], "Adam state was restored (not empty)"
        # The restore opened no checkpoint; the spies do see the regular load.
        assert out["calls_restore"] == 0 and out["calls_checkpoint"] > 0
        _assert_equal(out["final"], out["final_ckpt"], f"rank {rank} after {MORE} steps")
        assert not torch.equal(out["final"]["c.weight"], out["got"]["params"]["c.weight"])
    single = results[0]["final_single"]
    for k, v in results[0]["final"].items():
        torch.testing.assert_close(v, single[k], rtol=1e-5, atol=1e-6)


def test_adjacent_losses_raise_shards_lost() -> None:
    results = run_distributed(_lose, 2, 1, [1, 2], None, world_size=4, timeout=60)
    assert results[1] is None and results[2] is None
    for rank in (0, 3):
        message = results[rank]["lost"]
        assert "[1, 2]" in message and "adjacent" in message
        assert "restore from the newest checkpoint" in message


@pytest.mark.parametrize("stage", [2, 3])
def test_every_2_restores_the_older_common_step(stage: int) -> None:
    results = run_distributed(_lose, stage, 2, [2], None, world_size=4, timeout=60)
    for rank in (0, 1, 3):
        out = results[rank]
        assert out["step"] == 2  # steps 1..3 refreshed at 2 only
        _assert_equal(out["got"], out["ref"], f"rank {rank}")


def test_rank_lost_before_its_last_refresh_restores_the_step_before() -> None:
    # Rank 2 steps 3 times but leaves (its process ends) before sending its step-3 pieces:
    # rank 1's exchange of step 3 fails, so the survivors agree on step 2, which all still hold.
    results = run_distributed(_lose, 2, 1, [2], None, True, world_size=4, timeout=60)
    for rank in (0, 1, 3):
        out = results[rank]
        assert out["step"] == STEPS - 1
        if rank != 3:  # rank 3's send to rank 2 may or may not have left before rank 2 ended
            assert out["exchange_failed"] == (rank == 1)  # rank 1 mirrors rank 2
        _assert_equal(out["got"], out["ref"], f"rank {rank}")


def _killed(stage: int) -> dict[str, Any]:
    """Rank 2 SIGKILLs itself right after starting its step-3 refresh (its exchange may or may
    not have left); the survivors restore the newest step they all hold (2 or 3)."""
    survivors = dist.new_group([0, 1, 3])  # made while rank 2 lives: every rank must call it
    model, opt = _build(stage, None)
    mirror = ShardMirror(opt, model if stage == 3 else None)
    refs = {}
    for step in range(1, STEPS + 1):
        _step(model, opt, step, None)
        refs[step] = _full(model, opt, stage, None)
        mirror.after_step(step)
    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    restored = restore_shards(mirror, [2], survivors)
    new_model, new_opt = _build(stage, survivors)
    restored.load(new_opt, new_model if stage == 3 else None)
    got = _full(new_model, new_opt, stage, survivors)
    return {"step": restored.step, "got": got, "ref": refs[restored.step]}


def test_rank_killed_during_its_last_exchange_restores_a_common_step() -> None:
    results = run_distributed(_killed, 2, world_size=4, timeout=60, may_die=[2])
    assert results[2] is None
    steps = {results[r]["step"] for r in (0, 1, 3)}
    assert len(steps) == 1 and steps <= {STEPS - 1, STEPS}
    for rank in (0, 1, 3):
        _assert_equal(results[rank]["got"], results[rank]["ref"], f"rank {rank}")


def _gather_odd_sizes() -> list[float]:
    # Each rank contributes two snapshots (old ranks r and r + 2) whose first ends on an odd
    # byte: the second's fp32 pieces must still be readable in the gathered buffer.
    rank = dist.get_rank()
    mine = []
    for old in (rank, rank + 2):
        pieces = [(Piece("w", (4,), old, old + 1), torch.tensor([float(old)]))]
        pieces.append((Piece(f"flag{old}", (), 0, 1), torch.ones(1, dtype=torch.bool)))
        mine.append((old, pack(5, "zero", {"model": ShardedState({}, pieces)})))
    assert mine[0][1].nbytes % 2 == 1
    _, reader = readers(_gather(mine, None))["model"]
    return reader.full("w").tolist()


def test_gathered_snapshots_of_odd_sizes_stay_aligned() -> None:
    for values in run_distributed(_gather_odd_sizes, world_size=2, timeout=60):
        assert values == [0.0, 1.0, 2.0, 3.0]


def _bad_lost() -> list[str]:
    model, opt = _build(2, None)
    mirror = ShardMirror(opt)
    _step(model, opt, 1, None)
    mirror.after_step(1)
    mirror.wait()
    messages = []
    for lost in ([5], [-1], [dist.get_rank()], "1"):
        try:
            restore_shards(mirror, lost, None)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            messages.append(str(exc))
    return messages


def test_bad_lost_ranks_are_refused_naming_the_value() -> None:
    messages = run_distributed(_bad_lost, world_size=2, timeout=60)[1]
    assert len(messages) == 4
    assert "lost=5" in messages[0] and "0..1" in messages[0]
    assert "lost=-1" in messages[1]
    assert "lost=[1]" in messages[2] and "old rank 1" in messages[2]
    assert "lost='1'" in messages[3]


@pytest.mark.parametrize(("every", "error"), [(0, ValueError), ("2", TypeError), (True, TypeError)])
def test_bad_every_is_refused_naming_the_value(every: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"ShardMirror\(every={every!r}\): every must be an int >= 1"):
        ShardMirror(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), every=every)


@pytest.mark.parametrize(("timeout", "error"), [(0, ValueError), ("5", TypeError)])
def test_bad_timeout_is_refused_naming_the_value(timeout: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"ShardMirror\(timeout={timeout!r}\): timeout must be"):
        ShardMirror(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), timeout=timeout)


def _closed_under_a_waiting_peer() -> dict[str, Any]:
    """Rank 0 starts an exchange that rank 1 never joins; rank 1 closes its mirror, which it
    still holds (gloo closes a group's connections only when its object is freed, and the
    group has torch's 30-minute timeout). Rank 0's exchange must fail at once, not wait."""
    model, opt = _build(2, None)
    mirror = ShardMirror(opt)
    _step(model, opt, 1, None)
    if dist.get_rank() == 0:
        mirror.after_step(1)
    dist.barrier()
    out: dict[str, Any] = {}
    if dist.get_rank() == 1:
        mirror.close()
    else:
        start = time.monotonic()
        out = {"error": repr(mirror.settle()), "seconds": time.monotonic() - start}
    dist.barrier()  # rank 1 holds its mirror until rank 0 is done (the 20 s collective timeout)
    return out


def test_closing_a_mirror_frees_a_peer_waiting_on_its_part() -> None:
    out = run_distributed(_closed_under_a_waiting_peer, world_size=2, timeout=60)[0]
    assert out["error"] != "None" and out["seconds"] < 10, out


def test_common_step_takes_the_newest_step_held_by_all() -> None:
    reports = [
        {"rank": 0, "own": [2, 3], "mirror": [2, 3]},
        {"rank": 1, "own": [2, 3], "mirror": [2, 3]},
        {"rank": 3, "own": [2, 3], "mirror": [2, 3]},
    ]
    assert common_step(reports, [2], 4) == 3
    reports[1]["mirror"] = [2]  # rank 1's copy of rank 2's step 3 never arrived
    assert common_step(reports, [2], 4) == 2
    reports[1]["mirror"] = [1]
    with pytest.raises(ShardsLost, match=r"no step's shards are all held"):
        common_step(reports, [2], 4)
    with pytest.raises(RecoveryError, match=r"old ranks \[0, 1, 3\]"):
        common_step(reports, [1], 4)
