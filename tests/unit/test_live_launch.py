"""``phalanx run --recovery live`` in one process: the flag, the worker contract (variables and
the death marker), the replacement budget, log files of a replaced worker and the job's verdict.
The launcher end to end: ``tests/e2e/test_live_recovery.py``."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from phalanx.comm.signed import SignedStore
from phalanx.launch import live_keys
from phalanx.launch.args import ArgsError, parse_args
from phalanx.launch.live import JobBoard, LiveNode
from phalanx.launch.live_outcome import Death, NodeOutcome, node_outcome, to_json, verdict
from phalanx.launch.logs import StreamLogs, WorkerLogs
from phalanx.launch.options import build_parser
from phalanx.launch.summary import Failure
from phalanx.launch.worker_env import JobContext, Placement, worker_env
from phalanx.launch.workers import WorkerGroup, WorkerSpec
from phalanx.recovery.keys import FINISHED

SECRET = b"k" * 32
PLACE = Placement(rank=5, local_rank=2, world_size=8, local_world_size=4, node_rank=1, nnodes=2)


def test_recovery_flag_default_choice_and_refusals() -> None:
    assert parse_args(["x.py"], environ={}).recovery == "restart"
    assert parse_args(["--recovery", "live", "x.py"], environ={}).recovery == "live"
    with pytest.raises(ArgsError, match=r"--recovery 'sometimes' is not one of restart, live"):
        parse_args(["--recovery", "sometimes", "x.py"], environ={})
    with pytest.raises(ArgsError, match=r"--recovery live with --nnodes 1:2: .* replaces workers"):
        parse_args(["--recovery", "live", "--nnodes", "1:2", "x.py"], environ={})
    text = " ".join(build_parser({}).format_help().split())
    assert "restart (default)" in text and "restart stays the default" in text
    assert "--recovery live: how many dead workers are replaced, counted over the whole job" in text


def test_live_workers_get_their_slot_and_restart_workers_none_of_it() -> None:
    base = {"PATH": "/bin", "PHALANX_RECOVERY": "live", "PHALANX_INCARNATION": "4"}
    live = worker_env(base, PLACE, JobContext("h", 1, 0, 3, "r", recovery="live"))
    assert {k: live[k] for k in live_keys.LIVE_ENV} == {
        "PHALANX_RECOVERY": "live",
        "PHALANX_MEMBER_ID": "1.2",
        "PHALANX_INCARNATION": "0",
    }
    restart = worker_env(base, PLACE, JobContext("h", 1, 0, 3, "r"))
    assert not set(live_keys.LIVE_ENV) & set(restart)  # not even inherited from the launcher
    assert {k: v for k, v in live.items() if k not in live_keys.LIVE_ENV} == restart


def test_a_replacement_env_differs_only_in_its_incarnation() -> None:
    first = worker_env({}, PLACE, JobContext("h", 1, 0, 3, "r", recovery="live"))
    second = live_keys.replacement_env(first, 2)
    assert second == {**first, "PHALANX_INCARNATION": "2"}
    with pytest.raises(ValueError, match="incarnation of a replacement must be >= 1, got 0"):
        live_keys.replacement_env(first, 0)
    with pytest.raises(ValueError, match="PHALANX_RECOVERY is not live"):
        live_keys.replacement_env({"RANK": "0"}, 1)


def test_death_marker_is_a_signed_integer_that_only_grows() -> None:
    store = dist.HashStore()
    signer = live_keys.live_signer(store, SECRET, "n1")
    assert live_keys.dead_incarnation(signer, "0.1") is None
    live_keys.report_death(signer, "0.1", 1)
    raw = store.get("phalanx/live/dead/0.1").decode()
    magic, tag, payload = raw.split(" ")
    context = b"\0".join((b"phalanx-store/1", b"n1/live", b""))
    mine = hmac.new(SECRET, context + b"phalanx/live/dead/0.1\x001", hashlib.sha256).hexdigest()
    assert (magic, tag, payload) == ("phx1", mine, "1")  # the documented frame
    live_keys.report_death(signer, "0.1", 0)  # an older death never overwrites a newer one
    assert live_keys.dead_incarnation(signer, "0.1") == 1
    # A worker's signer over the prefix phalanx/live/ reads the same frame.
    prefixed = SignedStore(store, SECRET, "n1/live", "phalanx/live/")
    assert prefixed.get("dead/0.1") == 1
    assert (
        live_keys.dead_incarnation(live_keys.live_signer(store, b"other" * 8, "n1"), "0.1") is None
    )
    store.set("phalanx/live/dead/0.2", "phx1 - 0")  # forged: unsigned in a signed job
    assert live_keys.dead_incarnation(signer, "0.2") is None


def test_replacements_are_counted_over_the_whole_job() -> None:
    store = dist.HashStore()
    nodes = [JobBoard(SignedStore(store, SECRET, "agent/n"), 2) for _ in range(2)]
    claims = [nodes[0].claim_replacement("0.0"), nodes[1].claim_replacement("1.0")]
    assert claims == [1, 2]
    assert nodes[0].claim_replacement("0.0") is None and nodes[1].claim_replacement("1.1") is None
    assert not nodes[1].someone_finished()
    nodes[0].note_finished("0.1")
    assert nodes[1].someone_finished()  # seen from the other node


def _death(member: str, at: float, code: int, replaced: bool, late: bool = False) -> Death:
    rank = int(member.split(".")[1])
    failure = Failure(
        rank, rank, 0, 100 + rank, code, exception="RuntimeError: x" if code > 0 else None
    )
    return Death(member, 0, at, failure, replaced, late)


def test_verdict_smaller_world_fails_and_names_the_lost() -> None:
    # Issue 34: a slot lost for good is never a success, even when the others ran to the end.
    outcome = NodeOutcome(
        0, ["0.0", "0.2"], [_death("0.1", 1.0, -9, False), _death("0.3", 0.5, 1, True)]
    )
    assert node_outcome(to_json(outcome)) == outcome  # the agent store's round trip
    end = verdict([outcome, NodeOutcome(1, ["1.0", "1.1"], [])], max_replacements=1)
    assert (end.exit_code, end.failure) == (137, outcome.deaths[0].failure)
    assert end.lines == [
        "job failed: it finished at a smaller world, 4 of 5 workers ran to the end and 1 was "
        "lost for good (exit 137, the first loss's; raise --max-restarts to replace them)",
        "  first death (the cause): rank 3 (member 0.3, incarnation 0, pid 103): exit code 1; "
        "last error: RuntimeError: x",
        "  lost: rank 1 (member 0.1, incarnation 0, pid 101): signal SIGKILL (exit code 137)",
        "replacements used: 1 of 1 (--max-restarts)",
    ]
    replaced = NodeOutcome(0, ["0.0", "0.1"], [_death("0.1", 1.0, -9, True)])
    end = verdict([replaced], max_replacements=1)  # every slot back: success
    assert end.exit_code == 0
    assert end.lines[0] == "job finished: 2 of 2 workers ran to the end (exit 0)"


def test_verdict_fails_on_a_death_after_a_finish_or_when_nobody_finished() -> None:
    late = NodeOutcome(0, ["0.0"], [_death("0.1", 2.0, 3, False, late=True)])
    end = verdict([late], 0)
    assert end.exit_code == 3 and end.failure == late.deaths[0].failure
    assert end.lines[0] == "job failed: exit code 3 of a worker after another had finished"
    assert "  lost (after a worker had finished): rank 1 (member 0.1" in end.lines[1]
    assert "last error: RuntimeError: x" in end.lines[1]
    nobody = NodeOutcome(0, [], [_death("0.1", 2.0, 4, False), _death("0.0", 1.0, -9, False)])
    end = verdict([nobody], 0)
    assert (end.exit_code, end.lines[0]) == (128 + 9, "job failed: every worker was lost")
    clean = verdict([NodeOutcome(0, ["0.0", "0.1"], [])], 3)
    assert (clean.exit_code, clean.lines) == (0, [])  # a clean run stays quiet


def test_node_outcome_refuses_malformed_values() -> None:
    with pytest.raises(TypeError):
        node_outcome({"node": 0, "finished": [1], "deaths": []})
    with pytest.raises(TypeError):
        node_outcome({"node": 0, "finished": [], "deaths": [{"member": "0.1"}]})


def test_a_replaced_worker_appends_to_its_slots_log_files(tmp_path: Path) -> None:
    out = str(tmp_path / "stdout.log")
    logs = WorkerLogs(StreamLogs(out, console=False), StreamLogs(None, console=False))
    spec = WorkerSpec(0, 0, [sys.executable, "-c", "print('first')"], {}, logs=logs)
    group = WorkerGroup([spec])
    _wait_exit(group)
    old = group.workers[0]
    new = group.replace(
        0, dataclasses.replace(spec, command=[sys.executable, "-c", "print('second')"])
    )
    _wait_exit(group)
    group.join_threads(timeout=5.0)
    assert group.replaced == [old] and group.workers == [new] and new.pid != old.pid
    assert Path(out).read_text() == "first\nsecond\n"


def _wait_exit(group: WorkerGroup) -> None:
    deadline = time.monotonic() + 30
    while group.running():
        assert time.monotonic() < deadline, "the worker did not exit"
        time.sleep(0.02)


def _slot(local: int, code: str) -> WorkerSpec:
    env = {**live_keys.live_env(0, local), "PATH": "/usr/bin:/bin"}
    return WorkerSpec(local, local, [sys.executable, "-c", code], env, logs=_quiet())


def _quiet() -> WorkerLogs:
    return WorkerLogs(StreamLogs(None, console=False), StreamLogs(None, console=False))


def _live_node(specs: list[WorkerSpec], max_replacements: int) -> tuple[LiveNode, list[str]]:
    store, lines = dist.HashStore(), list[str]()
    board = JobBoard(SignedStore(store, SECRET, "agent/n"), max_replacements)
    dead = live_keys.live_signer(store, SECRET, "n")
    return LiveNode(WorkerGroup(specs), 0, board, dead, lines.append), lines


def _until_all_exited(node: LiveNode) -> NodeOutcome:
    deadline = time.monotonic() + 30
    while not node.all_exited():
        assert time.monotonic() < deadline, "the slots did not end"
        node.poll()
        time.sleep(0.02)
    node.workers.join_threads(timeout=5.0)
    return node.outcome()


def test_a_slot_that_dies_twice_is_replaced_once_then_lost_and_the_job_fails() -> None:
    specs = [_slot(0, "import time; time.sleep(1.5)"), _slot(1, "raise SystemExit(3)")]
    node, lines = _live_node(specs, max_replacements=1)
    outcome = _until_all_exited(node)
    assert [(d.member, d.incarnation, d.replaced) for d in outcome.deaths] == [
        ("0.1", 0, True),
        ("0.1", 1, False),
    ]
    assert node.workers.workers[1].spec.env["PHALANX_INCARNATION"] == "1"
    assert live_keys.dead_incarnation(node.dead, "0.1") == 1
    assert "replaced by pid" in lines[0] and "no replacement left (1 of 1 used" in lines[1]
    end = verdict([outcome], 1)
    assert end.exit_code == 3 and "1 of 2 workers ran to the end and 1 was lost" in end.lines[0]


def test_a_death_after_a_finish_is_not_replaced_and_fails_the_job() -> None:
    specs = [_slot(0, "pass"), _slot(1, "import time; time.sleep(1.5); raise SystemExit(3)")]
    node, lines = _live_node(specs, max_replacements=5)
    outcome = _until_all_exited(node)
    assert outcome.finished == ["0.0"] and [d.late for d in outcome.deaths] == [True]
    assert "not replaced, since a worker of the job already finished" in lines[0]
    assert verdict([outcome], 5).exit_code == 3


def test_a_worker_that_exits_0_tells_waiting_replacements_that_the_job_is_over() -> None:
    node, _ = _live_node([_slot(0, "pass")], max_replacements=1)
    assert node.dead.get(FINISHED) is None
    outcome = _until_all_exited(node)
    assert outcome.finished == ["0.0"] and node.dead.get(FINISHED) == "0.0"
