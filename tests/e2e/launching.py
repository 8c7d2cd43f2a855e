"""Helpers of the launcher's end-to-end tests: a clean environment, runs bound by a deadline.

Every launcher starts in its own session, so that on the deadline the whole process group
(launcher and workers) is killed before the test fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.testing import scaled

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
DEADLINE_S = 90


PHALANX_RUN = [sys.executable, "-m", "phalanx", "run"]
"""The real launcher's command line, as a user types ``phalanx run``."""


def standalone(nproc: int) -> list[str]:
    """``phalanx run --standalone --nproc-per-node NPROC``: one node, a local store."""
    return [*PHALANX_RUN, "--standalone", "--nproc-per-node", str(nproc)]


def launcher_env(*, path: str = "", **extra: str) -> dict[str, str]:
    """This environment without the variables the launcher decides (nor PET_ defaults), with
    ``src`` (and ``path``) on PYTHONPATH, plus ``extra``."""
    decided = ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    env = {k: v for k, v in os.environ.items() if k not in decided and not k.startswith("PET_")}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT / "src"), path, env.get("PYTHONPATH")])
    )
    return {**env, **extra}


def start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Start ``cmd`` in its own session, from the repository root, output captured."""
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], deadline: float = DEADLINE_S) -> tuple[str, str]:
    """Wait for ``proc``'s output; past the deadline (seconds on an idle machine, stretched by
    this one's measured slowness) kill its process group and fail."""
    deadline = scaled(deadline)
    try:
        return proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"{proc.args} did not finish in {deadline:.0f} s:\n{out}\n{err}")


def run_ok(cmd: list[str], **env: str) -> tuple[str, str]:
    """Run ``cmd`` (launcher_env plus ``env``) to its end; fail unless it exits 0."""
    proc = start(cmd, launcher_env(**env))
    out, err = finish(proc)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{out}\n{err}"
    return out, err


def run_ok_together(*cmds: list[str], **env: str) -> list[tuple[str, str]]:
    """``run_ok`` for each of ``cmds``, all started at once (a launcher and its workers start
    one after the other, so two such runs side by side keep both cores busy)."""
    procs = [start(cmd, launcher_env(**env)) for cmd in cmds]
    try:
        outputs = [finish(proc) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=10)
    for cmd, proc, (out, err) in zip(cmds, procs, outputs):
        assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{out}\n{err}"
    return outputs


def worker_envs(stdout: str) -> dict[str, dict[str, str]]:
    """The ``ENV {json}`` each worker of scripts/show_env.py printed, by its RANK.

    Each object is decoded where it starts, so two workers' lines run together on one shared
    pipe (torchrun's) still read as two.
    """
    decoder, found = json.JSONDecoder(), []
    for part in stdout.split("ENV {")[1:]:
        found.append(decoder.raw_decode("{" + part)[0])
    return {env["RANK"]: env for env in found}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
