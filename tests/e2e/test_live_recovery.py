"""``phalanx run --recovery live`` end to end: the dead worker alone is replaced.

Each job runs ``scripts/live_slot.py`` through the real CLI (``python -m phalanx run``): every
process records its pid and live variables in files, one slot SIGKILLs itself once after the
others started, and the others wait for its death marker in the worker store before they exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.launching import PHALANX_RUN, SCRIPTS, alive, finish, free_port, launcher_env, start

SCRIPT = str(SCRIPTS / "live_slot.py")

pytestmark = pytest.mark.timeout(200)


def _run(folder: Path, *flags: str, victim: str = "0.1", wait: str = "1") -> tuple[int, str]:
    proc = start([*PHALANX_RUN, *flags, SCRIPT, str(folder), victim, wait], launcher_env())
    out, err = finish(proc)
    return proc.returncode, out + err


def _record(folder: Path, member: str, incarnation: int, phase: str) -> dict[str, Any]:
    return dict(json.loads((folder / f"{member}.{incarnation}.{phase}.json").read_text()))


def _events(text: str) -> list[tuple[str, int | None]]:
    """(state, worker pid) of each torchrun event line (``--event-log-handler console``)."""
    found = []
    for line in text.splitlines():
        if line.startswith('{"name": "torchelastic.worker.status.'):
            event = json.loads(line)
            pid = json.loads(event["metadata"]["metadata"]).get("worker_pid", [None])[0]
            found.append((event["metadata"]["state"], pid))
    return found


def test_a_dead_worker_alone_is_replaced_and_the_others_keep_their_pids(tmp_path: Path) -> None:
    flags = [
        "--standalone",
        "--nproc-per-node",
        "3",
        "--recovery",
        "live",
        "--max-restarts",
        "1",
        "--event-log-handler",
        "console",
    ]
    code, text = _run(tmp_path, *flags)
    assert code == 0, text
    for member in ("0.0", "0.2"):  # one process each, start to end: never restarted
        begun, ended = _record(tmp_path, member, 0, "start"), _record(tmp_path, member, 0, "end")
        assert begun["pid"] == ended["pid"], text
        assert ended["dead"] == 0, text  # they read the death marker of 0.1's incarnation 0
        assert not (tmp_path / f"{member}.1.start.json").exists(), text
    dead, new = _record(tmp_path, "0.1", 0, "start"), _record(tmp_path, "0.1", 1, "start")
    assert not (tmp_path / "0.1.0.end.json").exists(), text
    assert dead["env"] == {**new["env"], "PHALANX_INCARNATION": "0"}, text  # same env but one
    assert new["env"]["PHALANX_INCARNATION"] == "1" and new["env"]["PHALANX_MEMBER_ID"] == "0.1"
    assert new["env"]["PHALANX_RECOVERY"] == "live"
    assert _record(tmp_path, "0.1", 1, "end")["dead"] == 0, text
    assert "starting ranks 0..2 of 3 on node 0 (generation 0, worker store" in text
    assert text.count(", --recovery live)") == 1  # said at start; one store, no new generation
    line = f"rank 1 (member 0.1, incarnation 0, pid {dead['pid']}): signal SIGKILL (exit code 137)"
    assert f"{line}: replaced by pid {new['pid']} (incarnation 1; replacement 1 of 1" in text
    assert "job failed" not in text and "lost" not in text, text
    events = _events(text)
    assert ("FAILED", dead["pid"]) in events and ("START", new["pid"]) in events, text
    assert ("SUCCEEDED", new["pid"]) in events and ("SUCCEEDED", None) in events, text


def test_with_no_replacement_left_the_survivors_finish_the_lost_is_named_and_the_job_fails(
    tmp_path: Path,
) -> None:
    flags = ["--standalone", "--nproc-per-node", "3", "--recovery", "live"]  # --max-restarts 0
    code, text = _run(tmp_path, *flags, wait="0")
    assert code == 137, text  # issue 34: a slot lost for good is never a success (SIGKILL's)
    assert {p.name for p in tmp_path.glob("*.end.json")} == {"0.0.0.end.json", "0.2.0.end.json"}
    pid = _record(tmp_path, "0.1", 0, "start")["pid"]
    lost = f"rank 1 (member 0.1, incarnation 0, pid {pid}): signal SIGKILL (exit code 137)"
    assert f"{lost}: no replacement left (0 of 0 used, --max-restarts); the others go on" in text
    head = "job failed: it finished at a smaller world, 2 of 3 workers ran to the end and 1 was "
    assert head + "lost for good (exit 137, the first loss's" in text, text
    assert f"  lost: {lost}" in text
    assert "replacements used: 0 of 0 (--max-restarts)" in text


def test_two_agents_each_replace_their_own_workers(tmp_path: Path) -> None:
    # Two agents on one machine (nodes 0 and 1 over loopback): node 1's worker dies, node 1's
    # agent replaces it and writes the death marker through node 0's worker store.
    procs = _two_agents(tmp_path, "--max-restarts", "1", wait="1.0", replace="1", secret="ab")
    outputs = [finish(p) for p in procs]
    text = "".join(out + err for out, err in outputs)
    assert [p.returncode for p in procs] == [0, 0], text
    survivor = _record(tmp_path, "0.0", 0, "start")
    assert survivor["pid"] == _record(tmp_path, "0.0", 0, "end")["pid"]
    assert _record(tmp_path, "0.0", 0, "end")["dead"] == 0
    new = _record(tmp_path, "1.0", 1, "start")
    assert new["env"]["PHALANX_MEMBER_ID"] == "1.0" and new["env"]["RANK"] == "1"
    assert "replaced by pid" in outputs[1][1] and "replaced by pid" not in outputs[0][1]


def test_bad_recovery_value_names_the_flag_and_the_value() -> None:
    proc = start([*PHALANX_RUN, "--recovery", "sometimes", SCRIPT], launcher_env())
    _, err = finish(proc)
    assert proc.returncode == 2, err
    assert "--recovery 'sometimes' is not one of restart, live" in err


def test_sigterm_still_stops_every_live_worker(tmp_path: Path) -> None:
    # The victim is a slot that does not exist: every worker waits for a marker that never comes.
    flags = ["--standalone", "--nproc-per-node", "2", "--recovery", "live"]
    proc = start([*PHALANX_RUN, *flags, SCRIPT, str(tmp_path), "9.9", "0"], launcher_env())
    _wait_started(proc, tmp_path, 2)
    pids = [_record(tmp_path, m, 0, "start")["pid"] for m in ("0.0", "0.1")]
    proc.send_signal(signal.SIGTERM)
    _, err = finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM; stopping the workers" in err
    assert not any(alive(pid) for pid in pids), err


def _wait_started(proc: subprocess.Popen[str], folder: Path, count: int) -> None:
    deadline = time.monotonic() + 90
    while len(list(folder.glob("*.start.json"))) < count:
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the workers did not start: {proc.communicate(timeout=10)}")
        time.sleep(0.05)


def _two_agents(
    folder: Path, *flags: str, wait: str = "9.9", replace: str = "0", secret: str = "cd"
) -> list[subprocess.Popen[str]]:
    """Nodes 0 and 1 (one worker each, over loopback) of a ``--recovery live`` job running
    ``live_slot.py`` with WAIT and WAIT_FOR_REPLACEMENT; ``flags`` go to both agents."""
    cmds, env = _agent_commands(folder, *flags, wait=wait, replace=replace, secret=secret)
    return [start(cmd, env) for cmd in cmds]


def _agent_commands(
    folder: Path, *flags: str, wait: str, replace: str, secret: str
) -> tuple[list[list[str]], dict[str, str]]:
    """The two agents' commands (see :func:`_two_agents`) and their environment."""
    common = [
        *("--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"),
        *("--master-port", str(free_port()), "--recovery", "live", *flags),
    ]
    env = launcher_env(PHALANX_JOB_SECRET=secret * 32, PHALANX_NODE_SILENCE_TIMEOUT="10")
    args = [SCRIPT, str(folder), wait, replace]
    return [[*PHALANX_RUN, *common, "--node-rank", str(n), *args] for n in (0, 1)], env


def _lose_node(
    procs: list[subprocess.Popen[str]], folder: Path, lost: int
) -> tuple[int, str, float]:
    """SIGKILL node ``lost`` (agent and worker) once both workers started; the other worker's
    pid, the other agent's stderr and how long it took to end."""
    try:
        _wait_started(procs[0], folder, 2)
        pid = _record(folder, f"{1 - lost}.0", 0, "start")["pid"]
        os.killpg(procs[lost].pid, signal.SIGKILL)
        killed = time.monotonic()
        _, err = finish(procs[1 - lost], deadline=60)
        return pid, err, time.monotonic() - killed
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)


def test_a_lost_node_1_is_a_loss_of_its_workers_and_the_job_goes_on(tmp_path: Path) -> None:
    # Node 1 (agent and worker) SIGKILLed: once its heartbeat has been silent for 10 s
    # (PHALANX_NODE_SILENCE_TIMEOUT; default 30) node 0 records its worker's death, the
    # survivor reads the marker and runs to the end at the smaller world; a slot lost for good
    # then fails the job (issue 34: never exit 0), naming the lost node.
    procs = _two_agents(tmp_path, wait="~1.0")
    pid, err, took = _lose_node(procs, tmp_path, 1)
    assert procs[0].returncode == 1, err
    assert "node 1 lost (no heartbeat from its agent for 10 s, PHALANX_NODE_SILENCE_TIMEOUT)" in err
    assert "rank 1 (member 1.0, incarnation 0) is lost; the others go on" in err
    head = "job failed: it finished at a smaller world, 1 of 2 workers ran to the end and 1 was "
    assert head + "lost for good (exit 1" in err, err
    end = _record(tmp_path, "0.0", 0, "end")
    assert end["pid"] == pid and end["dead"] == 0, end
    assert took < 25, f"took {took:.0f} s"


def test_a_lost_node_0_ends_the_live_job_with_a_clear_message(tmp_path: Path) -> None:
    # Node 0 hosts the stores: node 1's agent ends at its next store call.
    procs = _two_agents(tmp_path)
    pid, err, took = _lose_node(procs, tmp_path, 0)
    assert procs[1].returncode == 1, err
    assert "lost the rendezvous store" in err and "node 0's agent has probably exited" in err
    assert "node 0 hosts the live job's stores: losing it ends the whole job" in err
    assert took < 25, f"took {took:.0f} s"
    assert not alive(pid), err  # its worker was stopped


def test_a_slow_agent_declared_lost_stops_and_its_relaunch_rejoins(tmp_path: Path) -> None:
    # Node 1's agent is stopped (SIGSTOP) past the 10 s silence: node 0 declares the node lost.
    # Resumed, the agent finds that out before writing anything, stops its worker and exits 1;
    # the same command run again rejoins with a replacement, which the survivor waits for.
    cmds, env = _agent_commands(
        tmp_path, "--max-restarts", "1", wait="~1.0", replace="1", secret="ef"
    )
    procs = [start(cmd, env) for cmd in cmds]
    try:
        _wait_started(procs[0], tmp_path, 2)
        old = _record(tmp_path, "1.0", 0, "start")["pid"]
        os.kill(procs[1].pid, signal.SIGSTOP)  # the agent only: its worker runs on
        time.sleep(15)
        os.kill(procs[1].pid, signal.SIGCONT)
        _, slow_err = finish(procs[1], deadline=30)
        procs.append(start(cmds[1], env))
        (_, err0), (_, err1) = finish(procs[0]), finish(procs[2])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    assert procs[1].returncode == 1 and "node 0 declared node 1 lost" in slow_err, slow_err
    assert not alive(old), slow_err  # the dropped agent stopped its worker
    assert [procs[0].returncode, procs[2].returncode] == [0, 0], err0 + err1
    assert "node 1 rejoined: rank 1 (member 1.0, incarnation 1)" in err1, err1
    assert _record(tmp_path, "0.0", 0, "end")["dead"] == 0
    assert "job finished: 2 of 2 workers ran to the end (exit 0)" in err0, err0
