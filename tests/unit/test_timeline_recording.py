"""Switching the timeline on and what a rank records: the hooks in comm/ and train/, the
recorder's buffers, a one-process job, and ``phalanx run --timeline``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import cast

import pytest
import torch
from torch import nn

import phalanx
from phalanx.comm import wait_clock
from phalanx.diagnostics import job_timeline
from phalanx.diagnostics.flight import FlightRecorder, Record
from phalanx.diagnostics.rank_log import rank_path, read_rank_log
from phalanx.diagnostics.recorder import TimelineRecorder
from phalanx.launch.args import parse_args
from phalanx.launch.worker_env import JobContext, Placement, worker_env
from phalanx.train import observers
from phalanx.train.phases import PhaseClock


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", job_timeline.ENV_DIR):
        monkeypatch.delenv(var, raising=False)


def test_a_flight_recorder_hands_every_new_record_to_its_sinks() -> None:
    fr, seen = FlightRecorder(capacity=2), list[Record]()
    fr.add_sink(seen.append)
    for seq in range(1, 5):
        fr.start("0", seq, "all_reduce", "[1] float32", "t.py:1")
    fr.finish("0", 4)
    assert [r.seq for r in seen] == [1, 2, 3, 4]  # all of them, where the ring keeps 2
    assert seen[-1].end is not None  # the end is filled in, in place
    fr.remove_sink(seen.append)
    fr.start("0", 5, "barrier", "-", "t.py:2")
    assert len(seen) == 4


def test_wait_clock_watchers_see_each_counted_wait() -> None:
    seen: list[float] = []
    wait_clock.add_watcher(seen.append)
    try:
        wait_clock.add(0.25)
        with wait_clock.blocked(idle=True):  # an idle wait is never counted, nor watched
            pass
    finally:
        wait_clock.remove_watcher(seen.append)
    wait_clock.add(0.5)
    assert seen == [0.25]


class _Marks:
    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    def phase(self, name: str | None) -> None:
        self.seen.append(("phase", name))

    def relabel(self, name: str) -> None:
        self.seen.append(("relabel", name))

    def loss(self, value: torch.Tensor) -> None:
        self.seen.append(("loss", float(value.detach())))

    def stepping(self, step: int) -> None:
        self.seen.append(("stepping", step))

    def stepped(self, step: int) -> None:
        self.seen.append(("stepped", step))

    def saved(self, step: int) -> None:
        self.seen.append(("saved", step))

    def close(self) -> None:
        self.seen.append(("close", None))


def test_the_phase_clock_tells_its_observers_every_mark_and_relabel() -> None:
    clock, marks = PhaseClock(), _Marks()
    clock.observers.append(marks)
    clock.enter("data")
    clock.relabel("forward")
    clock.enter(None)
    assert marks.seen == [("phase", "data"), ("relabel", "forward"), ("phase", None)]


def test_a_registered_factory_observes_every_job(tmp_path: Path) -> None:
    made: list[observers.JobView] = []
    marks = _Marks()

    def factory(view: observers.JobView) -> _Marks:
        made.append(view)
        return marks

    observers.register(factory)
    try:
        with phalanx.Job("single", checkpoint_dir=tmp_path, straggler_check_every=0) as job:
            model, _ = job.setup(nn.Linear(2, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            job.backward(model(torch.ones(1, 2)).sum())
            job.step(opt)
            job.save(async_=False)
    finally:
        observers.unregister(factory)
    assert len(made) == 1 and made[0].lockstep and not made[0].live
    assert made[0].timeline_dir is None
    kinds = [k for k, _ in marks.seen]
    assert ("stepped", 1) in marks.seen and ("saved", 1) in marks.seen
    assert kinds[-1] == "close" and kinds[0] == "phase"


def _train(job: phalanx.Job, steps: int) -> None:
    model, _ = job.setup(nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = job.loader(torch.utils.data.TensorDataset(torch.ones(8, 2)), batch_size=2)
    for _ in job.epochs(1):
        for batch in job.progress(loader):
            (x,) = cast(list[torch.Tensor], batch)
            job.backward(model(x).sum())
            job.step(opt)
            if job.step_count == steps:
                break


def test_a_job_with_a_timeline_dir_records_its_phases_and_steps(tmp_path: Path) -> None:
    with phalanx.Job("single", timeline_dir=tmp_path, straggler_check_every=0) as job:
        _train(job, 3)
    log = read_rank_log(rank_path(tmp_path, 0))
    assert (log.rank, log.world_size) == (0, 1) and log.closed is not None
    assert [n for _, n in log.steps] == [1, 2, 3]
    names = [name for _, name in log.marks]
    assert names[:4] == ["data", "forward", "backward", "optimizer"]
    assert len(log.syncs) == 1 and log.syncs[0].offset == 0.0  # one rank: nothing to align


def test_the_environment_switches_it_on_and_its_numbers_are_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(job_timeline.ENV_DIR, str(tmp_path / "env"))
    with phalanx.Job("single", straggler_check_every=0) as job:
        _train(job, 2)
        assert job_timeline.current() is not None
    assert [n for _, n in read_rank_log(rank_path(tmp_path / "env", 0)).steps] == [1, 2]
    monkeypatch.setenv(job_timeline.ENV_SYNC_EVERY, "-3")
    with pytest.raises(ValueError, match="PHALANX_TIMELINE_SYNC_EVERY='-3' must be an integer"):
        phalanx.Job("single", straggler_check_every=0)
    assert not torch.distributed.is_initialized()  # the refused job left no group behind


def test_the_recorder_pauses_and_keeps_in_flight_operations_for_the_next_chunk(
    tmp_path: Path,
) -> None:
    rec = TimelineRecorder(tmp_path, rank=2, world_size=4, sync_every=0)
    rec.phase("forward")  # not recording yet: dropped
    rec.start()
    rec.phase("data")
    now = time.time()
    done = Record("0", 1, "all_reduce", "[1]", "t.py:1", now, now + 0.5)
    open_ = Record("0", 2, "all_reduce", "[1]", "t.py:2", now + 1)  # in flight at the flush
    for r in (done, open_):
        rec.add_op(r)
    wait_clock.add(0.125)
    rec.stepped(1)
    rec.flush()
    rec.pause()
    wait_clock.add(1.0)  # paused: not recorded
    open_.end = now + 1.5
    rec.close()
    log = read_rank_log(rec.path)
    assert [o.seq for o in log.ops] == [1, 2] and log.ops[1].end == now + 1.5
    assert [name for _, name in log.marks] == ["data"]
    assert len(log.waits) == 1 and log.waits[0][1] - log.waits[0][0] == pytest.approx(0.125)
    rec.close()  # twice: nothing


def test_phalanx_run_timeline_sets_the_workers_variable(tmp_path: Path) -> None:
    cfg = parse_args(["--timeline", "tl", "train.py"])
    assert cfg.timeline_dir is not None and Path(cfg.timeline_dir).is_absolute()
    assert cfg.timeline_dir.endswith("tl")
    place = Placement(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, nnodes=1)
    env = worker_env({}, place, JobContext("h", 1, 0, 0, "r", timeline_dir=cfg.timeline_dir))
    assert env[job_timeline.ENV_DIR] == cfg.timeline_dir
    assert job_timeline.ENV_DIR not in worker_env({}, place, JobContext("h", 1, 0, 0, "r"))
