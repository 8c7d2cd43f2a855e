"""``phalanx.LocalSGD`` / ``DiLoCo`` / ``StreamingDiLoCo``: options checked when built, presets
by name, the fragment plan, and what a checkpoint of replicas refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import phalanx
from phalanx.local_sgd import DiLoCoSync, LocalSGDSync, Outer, Replica
from phalanx.local_sgd.checkpoint import FORMAT, ReplicaModelState, replica_piece
from phalanx.local_sgd.fragments import default_offsets, due, split_fragments
from phalanx.sharding.pieces import PieceReader
from phalanx.train.strategies import resolve, strategy_names


@pytest.mark.parametrize(
    ("cls", "kwargs", "error", "message"),
    [
        (phalanx.LocalSGD, {"sync_every": 0}, ValueError, "LocalSGD(sync_every=0): sync_every"),
        (phalanx.LocalSGD, {"sync_every": 2.0}, TypeError, "sync_every must be an int >= 1"),
        (phalanx.LocalSGD, {"sync_every": True}, TypeError, "got bool True"),
        (phalanx.LocalSGD, {"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be a number > 0"),
        (phalanx.DiLoCo, {"sync_every": -1}, ValueError, "DiLoCo(sync_every=-1)"),
        (phalanx.DiLoCo, {"outer_lr": 0.0}, ValueError, "outer_lr must be a number > 0, got"),
        (phalanx.DiLoCo, {"outer_lr": float("nan")}, ValueError, "DiLoCo(outer_lr=nan)"),
        (phalanx.DiLoCo, {"outer_lr": "0.7"}, TypeError, "outer_lr must be a number > 0"),
        (phalanx.DiLoCo, {"outer_momentum": 1.0}, ValueError, "a number >= 0 and < 1, got"),
        (phalanx.DiLoCo, {"outer_momentum": -0.5}, ValueError, "DiLoCo(outer_momentum=-0.5)"),
        (phalanx.DiLoCo, {"nesterov": "yes"}, TypeError, "DiLoCo(nesterov='yes')"),
    ],
)
def test_bad_options_name_the_argument_and_value(
    cls: type, kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        cls(**kwargs)


def test_defaults_and_presets() -> None:
    assert phalanx.DiLoCo() == phalanx.DiLoCo(500, 0.7, 0.9, True)  # the paper's
    assert resolve("diloco") == phalanx.DiLoCo()
    assert resolve("localsgd") == phalanx.LocalSGD()
    assert {"diloco", "localsgd"} <= set(strategy_names())
    assert phalanx.LocalSGD(sync_every=3).sync_every == 3


def test_the_algorithms_check_their_own_arguments() -> None:
    replica = Replica.of(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"LocalSGDSync\(every=0\)"):
        LocalSGDSync(replica, None, 0)
    with pytest.raises(ValueError, match=r"Outer\(momentum=1\): momentum must be a number >= 0"):
        Outer(momentum=1)
    with pytest.raises(ValueError, match=r"Outer\(lr=-1\)"):
        Outer(lr=-1)
    with pytest.raises(TypeError, match=r"DiLoCoSync\(outer=0.7\): outer must be a phalanx"):
        DiLoCoSync(replica, None, 2, 0.7)  # type: ignore[arg-type]


def test_replica_lists_trained_parameters_and_float_buffers() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    model[0].bias.requires_grad_(False)
    replica = Replica.of(model)
    assert [n for n, _ in replica.params] == ["0.weight", "1.weight", "1.bias"]
    # num_batches_tracked (an integer) is not averaged.
    assert [n for n, _ in replica.buffers] == ["1.running_mean", "1.running_var"]
    replica.param_tensors[0].fill_(2.0)  # views of the model's parameters
    assert torch.equal(model[0].weight.detach(), torch.full((3, 2), 2.0))


def test_replica_piece_is_a_row_of_a_stacked_tensor() -> None:
    piece = replica_piece("w", torch.zeros(2, 3), rank=1, world_size=4)
    assert (piece.key, piece.shape, piece.start, piece.end) == ("replica/w", (4, 2, 3), 6, 12)


def test_a_checkpoint_of_another_world_size_is_refused() -> None:
    model = nn.Linear(2, 2)
    view = ReplicaModelState(model, LocalSGDSync(Replica.of(model), None, 4), 0, 1)
    meta = {"format": FORMAT, "world_size": 2, "steps": 1}
    with pytest.raises(ValueError, match=r"holds 2 replicas .* resume at world_size=2"):
        view.load_sharded_state(meta, PieceReader([], lambda source: {}))
    with pytest.raises(ValueError, match="not saved by LocalSGD or DiLoCo"):
        view.load_sharded_state({"format": "phalanx.zero/1"}, PieceReader([], lambda s: {}))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fragments": 0}, r"StreamingDiLoCo\(fragments=0\): fragments must be an int >= 1"),
        ({"overlap": 100}, r"StreamingDiLoCo\(overlap=100\): overlap must be an int in 0..99"),
        ({"offsets": (0,)}, r"StreamingDiLoCo\(offsets=\(0,\)\): one offset per fragment"),
        ({"sync_every": 4, "fragments": 2, "offsets": (0, 4)}, "must be < sync_every=4, got"),
        ({"offsets": (0, -1, 0, 0)}, r"offsets\[1\] must be an int >= 0, got int -1"),
        ({"quantise": "int2"}, r"StreamingDiLoCo\(quantise='int2'\): quantise must be one of"),
        ({"quantise_block": 0}, r"quantise_block must be an int >= 1"),
    ],
)
def test_streaming_options_are_checked(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        phalanx.StreamingDiLoCo(**kwargs)


def test_streaming_presets_and_defaults() -> None:
    s = resolve("streaming-diloco")
    assert isinstance(s, phalanx.StreamingDiLoCo) and s == phalanx.StreamingDiLoCo()
    assert (s.sync_every, s.fragments, s.overlap, s.offsets) == (100, 4, 1, None)
    assert phalanx.StreamingDiLoCo(fragments=2, offsets=[0, 50]).offsets == (0, 50)


def test_fragments_are_balanced_runs_of_consecutive_parameters() -> None:
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]  # every run non-empty
    assert split_fragments([1, 1, 100], 2) == [[0, 1], [2]]
    assert split_fragments([5], 1) == [[0]]
    with pytest.raises(ValueError, match="fragments=3 must be between 1 and the number of"):
        split_fragments([1, 1], 3)
    assert default_offsets(8, 3) == [0, 2, 5]
    assert [s for s in range(1, 13) if due(s, 4, 0)] == [4, 8, 12]
    assert [s for s in range(1, 13) if due(s, 4, 2)] == [2, 6, 10]


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A world of one: no launcher's variables."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.usefixtures("alone")
def test_fp16_and_a_missing_optimizer_are_refused() -> None:
    with pytest.raises(ValueError, match=r"precision='fp16-mixed' with strategy LocalSGD\("):
        phalanx.Job(phalanx.LocalSGD(), precision="fp16-mixed")
    assert not phalanx.is_initialized()
    with phalanx.Job("diloco") as job, pytest.raises(ValueError, match="pass the optimizer"):
        job.setup(nn.Linear(2, 2), None)


@pytest.mark.usefixtures("alone")
def test_alone_diloco_restarts_from_theta_every_h_steps_and_sends_nothing_for_localsgd() -> None:
    for strategy in (phalanx.DiLoCo(sync_every=2), phalanx.LocalSGD(sync_every=2)):
        with phalanx.Job(strategy, straggler_check_every=0) as job:
            model = nn.Linear(3, 2)
            opt = torch.optim.AdamW(model.parameters(), 0.1)
            model, _ = job.setup(model, opt, loss_fn=torch.nn.functional.mse_loss)
            for _ in range(4):
                job.forward_backward(torch.randn(4, 3), torch.randn(4, 2))
                job.step()
            sync = job.runner.sync  # type: ignore[attr-defined]
            assert sync.stats.syncs == 2
            if isinstance(sync, DiLoCoSync):
                assert all(map(torch.equal, sync.global_params, model.parameters()))
                assert sync.outer.state  # the momentum exists after two outer steps
            else:
                assert sync.stats.bytes_sent == 0  # nothing to average with


@pytest.mark.usefixtures("alone")
def test_a_diloco_checkpoint_exports_theta_to_a_plain_model(tmp_path: Path) -> None:
    with phalanx.Job(phalanx.DiLoCo(sync_every=2), checkpoint_dir=tmp_path) as job:
        model = nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters(), 0.1)
        model, _ = job.setup(model, opt, loss_fn=torch.nn.functional.mse_loss)
        for _ in range(3):  # one outer step, then one inner step: θ != the local model
            job.forward_backward(torch.randn(4, 3), torch.randn(4, 2))
            job.step()
        job.save(async_=False)
        theta = [t.clone() for t in job.runner.sync.global_params]  # type: ignore[attr-defined]
        assert not torch.equal(theta[0], model.weight.detach())
    plain = nn.Linear(3, 2)
    with pytest.warns(UserWarning, match=r"unexpected .*momentum/bias.*replica/weight"):
        phalanx.checkpoint.load(tmp_path, model=plain, strict=False)
    assert torch.equal(plain.weight.detach(), theta[0])
    assert torch.equal(plain.bias.detach(), theta[1])


def _frozen_job(path: Path) -> tuple[phalanx.Job, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)  # AdamW never steps it: it has no state
    opt = torch.optim.AdamW(model.parameters(), 0.1)
    job = phalanx.Job(phalanx.LocalSGD(sync_every=2), checkpoint_dir=path)
    model, _ = job.setup(model, opt, loss_fn=torch.nn.functional.mse_loss)
    return job, model, opt


@pytest.mark.usefixtures("alone")
def test_resume_restores_the_inner_state_of_stepped_parameters_only(tmp_path: Path) -> None:
    job, model, opt = _frozen_job(tmp_path)
    with job:
        for _ in range(3):
            job.forward_backward(torch.randn(4, 3), torch.randn(4, 2))
            job.step()
        job.save(async_=False)
        saved = {i: dict(opt.state[p]) for i, p in enumerate(model.parameters()) if p in opt.state}
    job, model, opt = _frozen_job(tmp_path)
    with job:
        job.resume()
        assert model[0].weight not in opt.state
        for i, p in enumerate(model.parameters()):
            if i in saved:
                assert torch.equal(opt.state[p]["exp_avg"], saved[i]["exp_avg"])
                assert torch.equal(opt.state[p]["step"], saved[i]["step"])
        assert len(saved) == 3


def test_a_replica_of_the_wrong_type_is_refused_naming_the_argument_and_value() -> None:
    with pytest.raises(TypeError, match=r"LocalSGDSync\(replica='x'\): replica must be a Replica"):
        LocalSGDSync("x", None, 2)  # type: ignore[arg-type]
