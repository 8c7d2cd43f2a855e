"""``phalanx run`` end to end: real launcher processes, real workers, real signals.

The launcher is started as ``python -m phalanx.launch`` so these tests do not depend on the CLI.
Every subprocess has a deadline; the workers die with the launcher (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.launch import SpawnError, interface_for, main, spawn
from phalanx.testing import scaled
from tests.e2e.launching import alive, free_port
from tests.e2e.scripts import spawn_fns

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
LAUNCH = [sys.executable, "-m", "phalanx.launch"]
SleepingJob = tuple[subprocess.Popen[str], list[dict[str, int]], int]


def _env(**extra: str) -> dict[str, str]:
    # Unset so that the launcher's own choices for these two are visible to the test.
    unset = ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _launch(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LAUNCH, *args], capture_output=True, text=True, timeout=scaled(timeout), env=_env()
    )


def _worker_env(stdout: str, rank: int) -> dict[str, str | None]:
    prefix = f"[rank {rank}] ENV "
    line = next(line for line in stdout.splitlines() if line.startswith(prefix))
    return dict(json.loads(line[len(prefix) :]))


def test_two_workers_get_env_prefixes_and_all_reduce() -> None:
    script = str(SCRIPTS / "env_allreduce.py")
    proc = _launch(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--backend",
        "gloo",
        "--rdzv-id",
        "job7",
        script,
        "x",
        "--lr",
        "1",
    )
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] SUM 3" in proc.stdout
        assert f'[rank {rank}] ARGS ["x", "--lr", "1"]' in proc.stdout
        env = _worker_env(proc.stdout, rank)
        expected = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": "2",
            "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "job7",
            "PHALANX_RUN_ID": "job7",
            "PHALANX_RESTART_COUNT": "0",
            "PHALANX_BACKEND": "gloo",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }
        assert {k: env[k] for k in expected} == expected
        loopback = interface_for("127.0.0.1")
        assert loopback is not None and env["GLOO_SOCKET_IFNAME"] == loopback[0]
        assert env["MASTER_PORT"] == _worker_env(proc.stdout, 0)["MASTER_PORT"]


def test_failing_rank_stops_the_job_within_5s(tmp_path: Path) -> None:
    stamp = tmp_path / "failed_at"
    script = str(SCRIPTS / "fail_rank1.py")
    proc = _launch("--standalone", "--nproc-per-node", "2", script, str(stamp))
    # Measured from the failure itself: start-up time (torch import) depends on machine load.
    elapsed = time.time() - float(stamp.read_text())
    assert proc.returncode == 1, proc.stderr
    assert elapsed < 5.0, f"took {elapsed:.1f} s from the failure to the launcher's exit"
    assert "phalanx run: rank 1 failed (local rank 1 on node 0, pid " in proc.stderr
    assert "ValueError: boom" in proc.stderr.split("rank 1 failed", 1)[1]


def test_restart_after_sigkill_gets_a_fresh_store() -> None:
    proc = _launch(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(SCRIPTS / "kill_then_recover.py"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 0] attempt 1: rank 0 all_reduce ok" in proc.stdout
    assert "[rank 1] attempt 1: rank 1 all_reduce ok" in proc.stdout
    assert "restarting all workers (restart 1 of 1" in proc.stderr
    assert "(generation 1, worker store 127.0.0.1:" in proc.stderr  # a fresh store per generation
    assert ", --recovery restart)" in proc.stderr  # the default, said in the start-up line


def test_sigkill_without_restarts_fails_naming_the_signal() -> None:
    proc = _launch("--standalone", "--nproc-per-node", "2", str(SCRIPTS / "kill_then_recover.py"))
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "rank 1 failed" in proc.stderr
    assert "signal SIGKILL (exit code 137)" in proc.stderr


def test_unresolvable_master_fails_within_5s(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    argv = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "no-such-host.invalid", "x.py"]
    assert main(argv) == 1
    assert time.monotonic() - start <= 5.0
    assert "'no-such-host.invalid' does not resolve" in capsys.readouterr().err


def test_port_in_use_names_the_port(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["--nproc-per-node", "1", "--master-port", str(port), "train.py"])
    assert code == 1
    assert f"port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err


def test_master_address_not_of_this_machine_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    # 198.51.100.0/24 is TEST-NET-2: never an address of this machine.
    assert main(["--master-addr", "198.51.100.7", "--master-port", "29590", "x.py"]) == 1
    assert "address 198.51.100.7 is not an address of this machine" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--nproc-per-node", "0"], ["--nproc-per-node", "0"]),
        (["--node-rank", "2", "--nnodes", "2"], ["--node-rank", "2", "--nnodes 2"]),
        (["--master-port", "70000"], ["--master-port", "70000"]),
        (["--backend", "foo"], ["--backend", "foo"]),
        (["--nnodes", "4:1"], ["--nnodes 4:1", "MIN=4 is larger than MAX=1"]),
        (["--max-restarts", "x"], ["--max-restarts", "'x'"]),
    ],
)
def test_malformed_flags_exit_2(
    flags: list[str], names: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*flags, "train.py"]) == 2
    err = capsys.readouterr().err
    for name in names:
        assert name in err


def test_malformed_flag_exit_code_of_the_process() -> None:
    proc = _launch("--master-port", "70000", "train.py", timeout=30)
    assert proc.returncode == 2
    assert "--master-port 70000 is outside the valid port range" in proc.stderr


def test_missing_script_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nproc-per-node", "2"]) == 2
    assert "missing the script" in capsys.readouterr().err


@pytest.fixture
def sleeping_job(tmp_path: Path) -> Iterator[SleepingJob]:
    """A launcher with 2 sleeping workers (each with a child); yields it, their pids, its port."""
    port = free_port()
    cmd = [
        *LAUNCH,
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        str(SCRIPTS / "sleeper.py"),
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    try:
        files = [tmp_path / f"rank{r}.json" for r in (0, 1)]
        deadline = time.monotonic() + scaled(30)
        while not all(f.exists() for f in files):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.05)
        yield proc, [json.loads(f.read_text()) for f in files], port
    finally:
        _stop_launcher(proc)


def _stop_launcher(proc: subprocess.Popen[str]) -> None:
    """SIGTERM (the launcher then stops its workers' process groups), SIGKILL if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=scaled(10))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=scaled(10))


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of LISTEN sockets on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                addr, hexport = local.rsplit(":", 1)
                if state == "0A" and int(hexport, 16) == port:
                    found.append(addr)
    return found


def test_stores_listen_on_loopback_only_and_sigterm_stops_every_worker_and_their_children(
    sleeping_job: SleepingJob,
) -> None:
    """One sleeping job for both: the stores it listens on, then SIGTERM ends it."""
    proc, workers, agent_port = sleeping_job
    worker_port = int(workers[0]["master_port"])
    assert worker_port != agent_port
    for port in (agent_port, worker_port):
        assert _listeners(port) == ["0100007F"], f"port {port}"
    pids = [w[k] for w in workers for k in ("pid", "child")]
    assert all(alive(pid) for pid in pids)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=scaled(10))
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM" in err
    deadline = time.monotonic() + scaled(5)
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if alive(pid)] == []


def test_spawn_all_reduce(tmp_path: Path) -> None:
    assert spawn(spawn_fns.all_reduce_to_file, args=(str(tmp_path),), nprocs=2, timeout=60) is None
    results = sorted(p.read_text() for p in tmp_path.glob("rank*.txt"))
    assert results == ["3 2 0", "3 2 1"]


def test_spawn_failure_names_the_rank_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(spawn_fns.rank1_raises, nprocs=2, timeout=60)
    message = str(info.value)
    assert message.startswith("rank 1 failed: ValueError: boom")
    assert "Traceback (most recent call last)" in message
    assert 'raise ValueError("boom")' in message
    assert info.value.rank == 1
    assert time.monotonic() - start < 30


def test_spawn_without_join_and_deadline() -> None:
    ctx = spawn(spawn_fns.rank1_raises, nprocs=1, join=False, timeout=1.0)
    assert ctx is not None
    pids = ctx.pids()
    assert ctx.join(timeout=0.01) is False
    with pytest.raises(SpawnError, match=r"timed out after 1\.0 s"):
        ctx.join()
    assert not any(alive(pid) for pid in pids)
