"""torchrun's options that change how ``phalanx run`` treats its workers, end to end.

Signals to forward and the grace before SIGKILL, per-worker variables (--role,
--virtual-local-rank, --local-addr), the event log, redirects without --log-dir, and a
``torchrun.logs_specs`` plugin. Every launcher runs in its own process group, killed on failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.launch import main
from phalanx.testing import scaled
from tests.e2e.launching import (
    DEADLINE_S,
    SCRIPTS,
    finish,
    launcher_env,
    run_ok,
    start,
    worker_envs,
)

LAUNCH = [sys.executable, "-m", "phalanx.launch", "--standalone", "--nproc-per-node", "2"]

pytestmark = pytest.mark.timeout(200)


def test_signals_to_handle_are_forwarded_then_the_grace_ends(tmp_path: Path) -> None:
    flags = ["--signals-to-handle", "SIGUSR1,SIGTERM", "--shutdown-timeout", "1"]
    proc = start([*LAUNCH, *flags, str(SCRIPTS / "usr1_sleeper.py"), str(tmp_path)], launcher_env())
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "workers did not start"
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGUSR1)
        out, err = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGUSR1, err
    assert "received SIGUSR1; stopping the workers (forwarding SIGUSR1)" in err
    assert "[rank 0] SIGUSR1 in rank 0" in out and "[rank 1] SIGUSR1 in rank 1" in out
    # The workers ignore it: SIGKILL after --shutdown-timeout 1 (the default grace is 3 s); the
    # rest (the launcher's teardown) stretches with the measured load (failed at 2.91 s, load 9).
    assert time.monotonic() - sent < 1.0 + scaled(1.9)


def test_role_virtual_local_rank_local_addr_and_events() -> None:
    flags = [
        "--role",
        "trainer",
        "--virtual-local-rank",
        "--local-addr",
        "127.0.0.1",
        "--event-log-handler",
        "console",
    ]
    out, err = run_ok([*LAUNCH, *flags, str(SCRIPTS / "show_env.py")], CUDA_VISIBLE_DEVICES="5,7")
    envs = worker_envs(out)
    assert [envs[r]["LOCAL_RANK"] for r in ("0", "1")] == ["0", "0"]
    assert [envs[r]["CUDA_VISIBLE_DEVICES"] for r in ("0", "1")] == ["5", "7"]
    assert {envs[r]["ROLE_NAME"] for r in ("0", "1")} == {"trainer"}
    assert envs["0"]["GLOO_SOCKET_IFNAME"] == "lo"
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    names = [
        (e["name"].rsplit(".", 1)[1], e["source"], e["metadata"]["global_rank"]) for e in events
    ]
    assert sorted(names, key=str) == sorted(
        [
            ("START", "WORKER", 0),
            ("START", "WORKER", 1),
            ("SUCCEEDED", "WORKER", 0),
            ("SUCCEEDED", "WORKER", 1),
            ("SUCCEEDED", "AGENT", None),
        ],
        key=str,
    )
    assert {e["metadata"]["role"] for e in events} == {"trainer"}


def test_bind_cores_pins_each_worker_to_its_own_cores_with_as_many_threads() -> None:
    out, err = run_ok([*LAUNCH, "--bind-cores", str(SCRIPTS / "show_cores.py")])
    seen = [
        json.loads(line.split("CORES ", 1)[1]) for line in out.splitlines() if "CORES {" in line
    ]
    mine = sorted(os.sched_getaffinity(0))
    first, second = (s["cores"] for s in sorted(seen, key=lambda s: s["rank"]))
    if len(mine) >= 2:  # each its own: disjoint, every core used
        assert not set(first) & set(second) and sorted(first + second) == mine
    else:
        assert first == second == mine
    for s in seen:
        assert s["omp"] == str(len(s["cores"])) and s["torch_threads"] == len(s["cores"]), s
        assert not s["bind_env_left"]  # the worker site read it and took it away
    assert "--bind-cores: each worker pinned to its cores, local rank 0 on" in err


def test_local_addr_of_another_machine_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--local-addr", "198.51.100.7", "x.py"]) == 1
    assert "--local-addr 198.51.100.7 is not an address of this machine" in capsys.readouterr().err


def test_redirects_without_log_dir_keep_a_temporary_directory() -> None:
    out, err = run_ok([*LAUNCH, "--redirects", "3", "-m", "tests.e2e.scripts.echo_streams"])
    assert "[rank" not in out and "[rank" not in err  # nothing on the console
    said = next(line for line in err.splitlines() if "worker logs of attempt 0 in " in line)
    attempt = Path(said.split(" in ", 1)[1])
    try:
        assert attempt.parent.parent.name.startswith("phalanx_logs_")
        assert (attempt / "1" / "stdout.log").read_text() == "out from 1\npartial 1 done\n"
        assert (attempt / "0" / "stderr.log").read_text() == "err from 0\n"
    finally:
        subprocess.run(["rm", "-rf", str(attempt.parent.parent)], check=True, timeout=30)


def test_logs_specs_plugin_decides_the_files(tmp_path: Path) -> None:
    """An entry point of group torchrun.logs_specs, installed as a dist-info on the path."""
    (tmp_path / "my_specs.py").write_text(
        "import os\n"
        "from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs\n"
        "class Marked(DefaultLogsSpecs):\n"
        "    def reify(self, envs):\n"
        "        open(os.path.join(self.root_log_dir, 'plugin-was-used'), 'w').close()\n"
        "        return super().reify(envs)\n"
    )
    info = tmp_path / "my_specs-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-specs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[torchrun.logs_specs]\nmarked = my_specs:Marked\n")
    logs = tmp_path / "logs"
    flags = ["--logs-specs", "marked", "--log-dir", str(logs), "--redirects", "1"]
    run_ok([*LAUNCH, *flags, "-m", "tests.e2e.scripts.echo_streams"], path=str(tmp_path))
    assert (logs / "plugin-was-used").exists()
    (run_dir,) = (p for p in logs.iterdir() if p.is_dir())
    assert (run_dir / "attempt_0" / "0" / "stdout.log").read_text().startswith("out from 0")
