"""Parameter server over c10d P2P: sync equals DDP's arithmetic, SSP bounds, exactly once,
malformed updates refused, lost workers tolerated (async / ssp) or named (sync)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.parameter_server import ParameterServer, ServerError, WorkerLost
from phalanx.testing import DistributedTestError, run_distributed

STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)


def _loss(model: nn.Module, worker: int, step: int) -> torch.Tensor:
    x, y = _batch(worker, step)
    return nn.functional.cross_entropy(model(x), y)


def _adamw(params: dict[str, nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params.values(), lr=0.05, weight_decay=0.1)


def _sgd(params: dict[str, nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params.values(), lr=0.1, momentum=0.9, weight_decay=0.01)


def _work(ps: ParameterServer, steps: int, delay: float = 0.0) -> None:
    assert ps.worker_index is not None
    while ps.worker.clock < steps and ps.pull():  # type: ignore[union-attr]
        ps.model.zero_grad()
        _loss(ps.model, ps.worker_index, ps.worker.clock).backward()  # type: ignore[union-attr]
        time.sleep(delay)
        ps.push()
    ps.close()


def _run(mode: str, bound: int | None, make_opt: object, num_servers: int = 1) -> dict:
    model = _model()
    ps = ParameterServer(model, make_opt, num_servers=num_servers, mode=mode, bound=bound)  # type: ignore[arg-type]
    report = ps.serve() if ps.is_server else None
    if not ps.is_server:
        _work(ps, STEPS)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"state": state, "report": report}


def _modes(num_servers: int) -> dict:
    return {
        "sync_sgd": _run("sync", None, _sgd, num_servers),
        "sync_adamw": _run("sync", None, _adamw, num_servers),
        "ssp0_adamw": _run("ssp", 0, _adamw, num_servers),
    }


def _reference(opt_fn: object, workers: int) -> dict[str, torch.Tensor]:
    """Data parallel's arithmetic in one process: the gradient averaged over the workers."""
    model = _model()
    opt = opt_fn(dict(model.named_parameters()))  # type: ignore[operator]
    for step in range(STEPS):
        opt.zero_grad()
        grads = []
        for w in range(workers):
            model.zero_grad()
            _loss(model, w, step).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).mean(0)
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("num_servers", [1, 2])
def test_sync_equals_data_parallel_and_ssp0_equals_sync(num_servers: int) -> None:
    world = num_servers + 2
    results = run_distributed(_modes, num_servers, world_size=world, timeout=90)
    for name, opt in (("sync_sgd", _sgd), ("sync_adamw", _adamw)):
        ref = _reference(opt, 2)
        for r in results[num_servers:]:  # workers end with every shard's final parameters
            for k, v in r[name]["state"].items():
                # The same gradients averaged in another order than in one process: float
                # rounding only, hence a tight tolerance.
                torch.testing.assert_close(v, ref[k], rtol=1e-5, atol=1e-6, msg=f"{name} {k}")
    for rank in range(num_servers, world):  # ssp with s = 0 is sync, to the bit
        for k, v in results[rank]["ssp0_adamw"]["state"].items():
            assert torch.equal(v, results[rank]["sync_adamw"]["state"][k]), k
    report = results[0]["sync_sgd"]["report"]
    assert report.version == STEPS and report.applied == 2 * STEPS
    assert report.staleness == {0: 2 * STEPS} and not report.lost and not report.rejected


# ---- SSP bound, exactly once, malformed updates --------------------------------------------
def _ssp_and_duplicates(bound: int) -> dict:
    model = _model()
    ps = ParameterServer(model, _sgd, mode="ssp", bound=bound)
    if ps.is_server:
        return {"report": ps.serve()}
    # worker 1 is slow, so worker 0 runs into the bound
    _work(ps, 12, delay=0.03 if ps.worker_index == 1 else 0.0)
    out = {"history": ps.history.pulls}
    model = _model()
    ps = ParameterServer(model, _sgd, mode="async")
    assert ps.worker is not None
    ps.pull()
    _loss(model, ps.worker.index, 0).backward()
    ps.push()
    ps.worker.clock -= 1  # send (worker, step 0) again: it must not be applied twice
    ps.push()
    ps.close()
    return out


def _server_async_report() -> dict:
    model = _model()
    ps = ParameterServer(model, _sgd, mode="async")
    return {"report": ps.serve()}


def _bound_and_exactly_once(bound: int) -> dict:
    if dist.get_rank() == 0:
        first = _ssp_and_duplicates(bound)
        return {**first, "async": _server_async_report()["report"]}
    return _ssp_and_duplicates(bound)


def test_ssp_never_exceeds_its_bound_and_updates_apply_once() -> None:
    bound = 2
    results = run_distributed(_bound_and_exactly_once, bound, world_size=3, timeout=90)
    ssp = results[0]["report"]
    # From the recorded versions: every gradient was computed at most `bound` versions ago...
    assert ssp.staleness and max(ssp.staleness) <= bound
    for r in results[1:]:
        lags = [clock - version for clock, version in r["history"]]
        assert len(lags) == 12 and max(lags) <= bound
    # ... and each (worker, step) applied once: 2 workers x 12 steps.
    assert ssp.applied == 24 and ssp.version == 12
    asynchronous = results[0]["async"]
    assert asynchronous.duplicates == 2 and asynchronous.applied == 2
    assert asynchronous.version == 2


def _malformed() -> dict:
    model = _model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    ps = ParameterServer(model, _sgd, mode="async")
    workers = dist.new_group([1, 2])
    if ps.is_server:
        return {"report": ps.serve()}
    assert ps.worker is not None
    error = ""
    ps.pull()
    if ps.worker.index == 1:
        _loss(model, 1, 0).backward()
        model[2].bias.grad[1] = float("nan")  # type: ignore[index]
        ps.push()
        try:
            ps.pull()
        except ServerError as exc:
            error = str(exc)
        assert ps.pull()  # the worker may carry on; the server state is untouched
    dist.barrier(group=workers)
    same = all(torch.equal(v, initial[k]) for k, v in model.state_dict().items())
    versions = list(ps.worker.versions)
    ps.close()
    return {"error": error, "same": same, "versions": versions}


def test_malformed_update_is_refused_and_changes_nothing() -> None:
    results = run_distributed(_malformed, world_size=3, timeout=60)
    report = results[0]["report"]
    assert report.applied == 0 and report.version == 0 and len(report.rejected) == 1
    error = results[2]["error"]
    assert "worker 1" in error and "'2.bias'" in error and "1 NaN" in error, error
    assert results[1]["same"] and results[2]["same"] and results[2]["versions"] == [0]


# ---- lost workers ----------------------------------------------------------------------------
def _lose_worker(mode: str, how: str) -> dict:
    model = _model()
    bound = 1 if mode == "ssp" else None
    ps = ParameterServer(model, _sgd, mode=mode, bound=bound, heartbeat=0.2, dead_after=1.5)
    if ps.is_server:
        start = time.monotonic()
        try:
            return {"report": ps.serve(), "seconds": time.monotonic() - start}
        except WorkerLost as exc:
            return {"error": str(exc), "seconds": time.monotonic() - start}
    assert ps.worker is not None
    if ps.worker.index == 1:
        for _ in range(3):
            ps.pull()
            _loss(model, 1, ps.worker.clock).backward()
            ps.push()
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        ps.worker._stop_heartbeats()  # hung: alive, connected, silent
        time.sleep(4)
        return {}
    try:
        _work(ps, 20, delay=0.01)
    except WorkerLost as exc:
        return {"error": str(exc)}
    return {"clock": ps.worker.clock}


@pytest.mark.parametrize(("mode", "how"), [("async", "kill"), ("ssp", "hang"), ("sync", "kill")])
def test_lost_worker(mode: str, how: str) -> None:
    results = run_distributed(_lose_worker, mode, how, world_size=3, timeout=60, may_die=[2])
    server = results[0]
    if mode == "sync":
        # The job stops, naming the lost worker, on the server and on the surviving worker.
        assert "worker 1 (group rank 2)" in server["error"] and "mode='sync'" in server["error"]
        assert server["error"] == results[1]["error"]
        return
    report = server["report"]
    assert list(report.lost) == [1] and results[1]["clock"] == 20
    assert report.applied == 3 + 20
    if how == "hang":
        assert "sent nothing for" in report.lost[1]


def test_bad_arguments() -> None:
    with pytest.raises(DistributedTestError, match="num_servers=2 with a group of 2 ranks"):
        run_distributed(_bad, 2, world_size=2, timeout=30)


def _bad(num_servers: int) -> None:
    ParameterServer(_model(), _sgd, num_servers=num_servers)


def test_constructor_checks_mode_and_bound() -> None:
    with pytest.raises(DistributedTestError, match=r"mode='ssp' needs a staleness bound"):
        run_distributed(_bad_mode, world_size=2, timeout=30)


def _bad_mode() -> None:
    phalanx.world()
    ParameterServer(_model(), _sgd, mode="ssp")


def _rogue() -> dict:
    from phalanx.parameter_server import Kind, encode_header, wire

    model = _model()
    ps = ParameterServer(model, _sgd, mode="async")
    dist.barrier()  # the server is up before the hostile message leaves
    if ps.is_server:
        return {"report": ps.serve()}
    assert ps.worker is not None
    if ps.worker.index == 1:  # announces a 2**40-element PUSH: refused before allocating
        ps.worker._stop_heartbeats()
        bad = encode_header(Kind.PUSH, worker=1, numel=2**40, dtype=torch.float32)
        wire.send(bad, 0, dist.group.WORLD)  # type: ignore[arg-type]
        time.sleep(1.0)
        return {}
    _work(ps, 10)
    return {"clock": ps.worker.clock}


def test_hostile_header_drops_its_sender_and_the_others_carry_on() -> None:
    results = run_distributed(_rogue, world_size=3, timeout=60)
    report = results[0]["report"]
    assert list(report.lost) == [1] and "malformed header" in report.lost[1]
    assert "'numel' = 1099511627776" in report.lost[1]
    assert results[1]["clock"] == 10 and report.applied == 10


def _authenticated() -> dict:
    from datetime import timedelta

    from phalanx.parameter_server import Kind, encode_header, wire

    if dist.get_rank() == 2:  # a process of the group that does not know the job's secret
        os.environ["PHALANX_JOB_SECRET"] = "not-the-secret"
    model = _model()
    ps = ParameterServer(model, _sgd, mode="async")
    dist.barrier()  # the server is up before the forged message leaves
    if ps.is_server:
        return {"report": ps.serve()}
    assert ps.worker is not None
    if ps.worker.index == 1:
        ps.worker._stop_heartbeats()
        grad = torch.full((ps.plan.numel(0),), 1e3)  # would wreck the model if applied
        push = encode_header(Kind.PUSH, worker=1, numel=grad.numel(), dtype=grad.dtype, flags=4)
        sent = wire.send(push, 0, dist.group.WORLD, grad, wait=False)  # type: ignore[arg-type]
        reply = torch.empty(13, dtype=torch.int64)
        work = dist.irecv(reply, 0, tag=7301)
        try:
            work.wait(timedelta(seconds=5))
            got_reply = True
        except RuntimeError:
            got_reply = False  # no answer: it could not read the parameters
        del sent  # its tensors had to live while the server read the header
        return {"got_reply": got_reply}
    _work(ps, 5)
    return {"clock": ps.worker.clock}


def test_process_without_the_secret_can_neither_read_nor_write() -> None:
    results = run_distributed(
        _authenticated, world_size=3, timeout=60, env={"PHALANX_JOB_SECRET": "s3cret"}
    )
    report = results[0]["report"]
    assert list(report.lost) == [1] and "failed authentication" in report.lost[1]
    assert results[2]["got_reply"] is False
    # Only the authenticated worker's 5 gradients were applied; the forged one was not.
    assert results[1]["clock"] == 5 and report.applied == 5 and report.version == 5
