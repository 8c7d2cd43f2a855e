"""The "auto" backend across machines (issue 35, "choose the backend by measurement"): CPU ranks
on several machines that each run 2 or more get the hierarchical shm group (shared memory inside
each machine, gloo between them), measured faster than gloo at 100 Mbit/s and 1 Gbit/s by
``phalanx bench hosts_backend``; a machine with a single rank, a machine that cannot run shm, or
a launcher that does not know the other machines' rank counts keeps gloo. The launcher learns
the fewest ranks per machine at its rendezvous, passes it to the workers as
``PHALANX_MIN_LOCAL_WORLD_SIZE`` and says what they get in its start-up line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.comm import backends, group
from phalanx.comm.env import discover_env
from phalanx.launch import rendezvous
from phalanx.launch.agent_values import Joined
from phalanx.launch.args import parse_args
from phalanx.launch.attempt import worker_specs
from phalanx.launch.backend_note import BackendNotes, backend_note
from phalanx.launch.logs import RunLogs
from phalanx.launch.rendezvous import AgentStore
from tests.unit.test_rendezvous import NOW, _agents

HIERARCHICAL = (
    "hierarchical: shared memory inside each machine, gloo between them; measured faster than "
    "gloo across machines"
)


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU machine that can run shm, whatever this one is; no PHALANX_BACKEND inherited."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(backends, "shm_unusable", lambda: None)
    monkeypatch.setattr(rendezvous, "shm_unusable", lambda: None)
    monkeypatch.delenv("PHALANX_BACKEND", raising=False)


def test_the_auto_rule_in_every_case(monkeypatch: pytest.MonkeyPatch) -> None:
    auto = backends.auto_backend
    assert auto(gpu=False, one_machine=True) == ("shm", "CPU ranks on one machine")
    assert auto(gpu=False, one_machine=False, fewest_local=2) == ("shm", HIERARCHICAL)
    assert auto(gpu=False, one_machine=False, fewest_local=8) == ("shm", HIERARCHICAL)
    assert auto(gpu=False, one_machine=False, fewest_local=1) == (
        "gloo",
        "CPU ranks on several machines, one of them with a single rank",
    )
    assert auto(gpu=False, one_machine=False) == ("gloo", "")  # unknown: not phalanx run
    for one_machine, fewest in [(True, 0), (False, 2), (False, 1), (False, 0)]:
        assert auto(gpu=True, one_machine=one_machine, fewest_local=fewest)[0] == "nccl"
    monkeypatch.setattr(backends, "shm_unusable", lambda: "Darwin on arm64")
    assert auto(gpu=False, one_machine=False, fewest_local=2) == (
        "gloo",
        "CPU ranks on several machines, but shm cannot run on Darwin on arm64",
    )


def test_workers_resolve_auto_with_the_fewest_ranks_per_machine() -> None:
    assert group.resolve_backend(None, 0, one_machine=False, fewest_local=2) == "shm"
    assert group.resolve_backend("auto", 0, one_machine=False, fewest_local=3) == "shm"
    assert group.resolve_backend(None, 0, one_machine=False, fewest_local=1) == "gloo"
    assert group.resolve_backend(None, 0, one_machine=False) == "gloo"
    assert group.resolve_backend("gloo", 0, one_machine=False, fewest_local=2) == "gloo"


def _launched(monkeypatch: pytest.MonkeyPatch, source: str, fewest: str | None) -> None:
    for var in ("PHALANX_RUN_ID", "TORCHELASTIC_RUN_ID", backends.MIN_LOCAL_ENV):
        monkeypatch.delenv(var, raising=False)
    run_id = "PHALANX_RUN_ID" if source == "phalanx" else "TORCHELASTIC_RUN_ID"
    monkeypatch.setenv(run_id, "job")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    if fewest is not None:
        monkeypatch.setenv(backends.MIN_LOCAL_ENV, fewest)


def test_only_phalanx_runs_word_on_every_machine_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    _launched(monkeypatch, "phalanx", "2")
    assert group.fewest_local_ranks(discover_env(), 4) == 2
    assert group.fewest_local_ranks(discover_env(), 8) == 0  # a world it did not make
    _launched(monkeypatch, "phalanx", None)
    assert group.fewest_local_ranks(discover_env(), 4) == 0
    _launched(monkeypatch, "torchrun", "2")  # torchrun does not know the other nodes
    assert group.fewest_local_ranks(discover_env(), 4) == 0
    _launched(monkeypatch, "phalanx", "two")
    with pytest.raises(ValueError, match="PHALANX_MIN_LOCAL_WORLD_SIZE='two' is not a count"):
        group.fewest_local_ranks(discover_env(), 4)


def test_the_start_up_line_says_hierarchical_shm_and_how_to_opt_out() -> None:
    assert backend_note(None, 4, 2, fewest_local=2) == (
        f", default backend shm ({HIERARCHICAL}; --backend gloo opts out)"
    )
    assert backend_note(None, 3, 2, fewest_local=1) == (
        ", default backend gloo (CPU ranks on several machines, one of them with a single rank)"
    )
    assert backend_note(None, 4, 2, fewest_local=0) == (
        ", default backend gloo (CPU ranks on several machines)"
    )
    assert backend_note("gloo", 4, 2, fewest_local=2) == ", backend gloo"
    assert backend_note("shm", 4, 2, fewest_local=1) == (
        ", backend shm (shared memory inside each machine, gloo between the machines)"
    )


def test_an_elastic_job_is_told_when_a_single_rank_node_changes_the_default() -> None:
    notes = BackendNotes(None, environ={})
    assert notes.note(4, 2, 2) == f", default backend shm ({HIERARCHICAL}; --backend gloo opts out)"
    assert notes.note(5, 2, 1) == (
        ", default backend gloo (changed from shm: CPU ranks on several machines, one of them "
        "with a single rank; --backend shm keeps shm)"
    )
    assert notes.note(4, 2, 2) == (
        f", default backend shm (changed from gloo: {HIERARCHICAL}; --backend gloo keeps gloo)"
    )
    assert notes.note(2, 2, 2) == (
        ", default backend shm (CPU ranks on one machine; --backend gloo opts out)"
    )


def _join(node: AgentStore, nproc: int, shm: bool) -> None:
    """What ``rendezvous`` writes for a non-zero node before it waits."""
    node._read_config(1, NOW)
    node._claim_node_rank(0)
    node._put(node._key(0, "nproc", node.node_rank), {"nproc": nproc, "host": "h", "shm": shm})


@pytest.mark.parametrize(
    ("nprocs", "shm", "fewest"),
    [
        ((2, 2), (True, True), 2),
        ((4, 3), (True, True), 3),
        ((2, 1), (True, True), 1),
        ((2, 4), (True, False), 0),  # shm cannot run on node 1: gloo for everyone
    ],
)
def test_the_rendezvous_agrees_on_the_fewest_ranks_per_node(
    nprocs: tuple[int, int], shm: tuple[bool, bool], fewest: int
) -> None:
    _, (node0, node1) = _agents(2)
    node0.publish_config("run1", 0)
    _join(node1, nprocs[1], shm[1])
    rdzv = node0.rendezvous(0, nprocs[0], 4242, timeout=1, check_stop=NOW)
    assert rdzv.fewest_local == fewest
    formed = node1.formed(0, 1, NOW)  # what node 1 reads from the same records
    assert formed is not None and (formed.rank_offset, formed.fewest_local) == (nprocs[0], fewest)


def test_a_join_record_says_whether_shm_runs_there_and_old_records_still_parse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, (node0, node1) = _agents(2)
    node0.publish_config("run1", 0)
    monkeypatch.setattr(rendezvous, "shm_unusable", lambda: "Linux on aarch64")
    node1._read_config(1, NOW)
    node1._claim_node_rank(0)
    node1._put(node1._key(0, "nproc", 1), {"nproc": 2, "host": "h"})  # no "shm": it can
    assert node0.rendezvous(0, 2, 4242, timeout=1, check_stop=NOW).fewest_local == 0
    assert node0._get(node0._key(0, "nproc", 0), rendezvous.values.joined) == Joined(
        2, rendezvous._host(), False
    )
    assert node0._get(node0._key(0, "nproc", 1), rendezvous.values.joined) == Joined(2, "h")


def test_each_worker_gets_the_fewest_ranks_per_node(tmp_path: Path) -> None:
    flags = ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2"]
    cfg = parse_args([*flags, "--log-dir", str(tmp_path), "x.py"])
    rdzv = rendezvous.Rendezvous(0, 2, 5, 4242, 2, "run1", 0, fewest_local=2)
    logs = RunLogs(cfg.logs, lambda _: None)
    specs, _ = worker_specs(cfg, rdzv, None, logs, base={backends.MIN_LOCAL_ENV: "9"})
    assert [s.env[backends.MIN_LOCAL_ENV] for s in specs] == ["2", "2"]  # the launcher's word
