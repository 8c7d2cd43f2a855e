"""A local stranger writing into a job's two stores changes nothing; a wrong secret cannot join.

The stranger (``scripts/stranger.py``, no job secret) learns the agent store's port from the
launcher's output and the worker store's from the agent store, as anyone on the machine could.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from phalanx.testing import scaled

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "e2e" / "scripts"
LAUNCH = [sys.executable, "-m", "phalanx", "run"]
PORT_LINE = re.compile(r"rendezvous store listening on 127\.0\.0\.1:(\d+)")


class Job:
    """A running ``phalanx run`` whose stderr is read as it comes (for the store's port)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [*LAUNCH, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.err: list[str] = []
        self.out: list[str] = []
        self.port: int | None = None
        self._seen = threading.Event()
        self._pumps = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=lambda: self.out.extend(self.proc.stdout or ()), daemon=True),
        ]
        for pump in self._pumps:
            pump.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)
            if self.port is None and (m := PORT_LINE.search(line)):
                self.port = int(m.group(1))
                self._seen.set()
        self._seen.set()

    def agent_port(self) -> int:
        assert self._seen.wait(scaled(60)) and self.port is not None, "".join(self.err)
        return self.port

    def finish(self, timeout: float) -> tuple[int, str, str]:
        self.proc.wait(scaled(timeout))
        for pump in self._pumps:
            pump.join(10)
        return self.proc.returncode, "".join(self.out), "".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextmanager
def _job(args: list[str], **env: str) -> Iterator[Job]:
    job = Job(args, {**os.environ, "PHALANX_HANG_TIMEOUT": "1.5", **env})
    try:
        yield job
    finally:
        job.kill()


def _with_stranger(ckpt: Path, epochs: int) -> tuple[int, str, str, set[str]]:
    with _job(_stranger_job(ckpt, epochs), WAIT_FOR_STRANGER="1") as job:
        stranger = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "stranger.py"), str(job.agent_port()), "60"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            rc, out, err = job.finish(timeout=150)
            forged, _ = stranger.communicate(timeout=scaled(90))
        finally:
            stranger.kill()
    return rc, out, err, set(forged.split())


def _digest(out: str) -> str:
    return next(line.split()[-1] for line in out.splitlines() if "DIGEST" in line)


def _stranger_job(ckpt: Path, epochs: int) -> list[str]:
    script = [str(SCRIPTS / "stranger_job.py"), str(ckpt), str(epochs)]
    return ["--standalone", "--nproc-per-node", "2", *script]


def test_a_stranger_in_both_stores_changes_nothing(tmp_path: Path) -> None:
    # The clean run that the resumed one must end like runs beside the first stranger run (whose
    # ranks sit idle for most of its late all-reduce); it has no stranger, its own stores.
    with _job(_stranger_job(tmp_path / "clean", 3)) as clean:
        rc, out, err, forged = _with_stranger(tmp_path / "ckpt", 2)
        rc_clean, out_clean, err_clean = clean.finish(timeout=150)
    assert rc == 0, err
    assert {"phalanx/g0/failure", "phalanx/hang/who", "phalanx/hang/bell"} <= forged
    assert any("/checkpoint/<token>/" in k for k in forged), forged  # it forged session answers
    # A real hang is still reported, by every rank, while the stranger rings the hang bell.
    assert "[rank 0] Rank(s) [1] never reached it." in err, err
    assert "[rank 1] phalanx hang report #1 (opened by rank 0)" in err, err
    assert "forged report" not in err and "forged mismatch" not in err
    assert "in late_for_the_all_reduce" in err
    assert "ignored the value of store key 'phalanx/g0/failure'" in err
    assert "Traceback" not in err, err
    for manifest in (tmp_path / "ckpt").glob("step-*/manifest.json"):
        assert "evil" not in manifest.read_text()
    # It resumes from those checkpoints, stranger and all, and ends where a clean run ends.
    rc, out, err, forged = _with_stranger(tmp_path / "ckpt", 3)
    assert rc == 0, err
    assert "resumed from" in err and "Traceback" not in err
    assert rc_clean == 0, err_clean
    assert _digest(out) == _digest(out_clean)


IMPOSTOR = """
import sys, time
import phalanx
start = time.monotonic()
try:
    phalanx.init_process_group("gloo")
except Exception as exc:
    print(f"ELAPSED {time.monotonic() - start:.2f}")
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(3)
print("JOINED")
"""


def _job_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _worker_pids(launcher: int, deadline: float) -> list[int]:
    while time.monotonic() < deadline:
        out = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True)
        pids = [int(p) for p in out.stdout.split()]
        if len(pids) == 2:
            return pids
        time.sleep(0.1)
    raise AssertionError("the job's workers did not start")


def _impostor(env: dict[str, str], secret: str | None) -> subprocess.Popen[str]:
    """A hand-started twin of rank 1, with the job's environment but ``secret``."""
    env = {**env, "RANK": "1", "LOCAL_RANK": "1"}
    env.pop("PHALANX_JOB_SECRET")
    if secret is not None:
        env["PHALANX_JOB_SECRET"] = secret
    return subprocess.Popen(
        [sys.executable, "-c", IMPOSTOR],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_a_worker_with_a_wrong_secret_or_none_fails_at_rendezvous_naming_the_job(
    tmp_path: Path,
) -> None:
    """Two impostors at once, one with another secret and one with none, try the same job,
    which waits in its group until they are done (at most 60 s)."""
    done = tmp_path / "impostors-done"
    script = [str(SCRIPTS / "wait_in_group.py"), "60", str(done)]
    with _job(["--standalone", "--nproc-per-node", "2", *script]) as job:
        env = _job_env(_worker_pids(job.proc.pid, time.monotonic() + scaled(60))[0])
        impostors = {secret: _impostor(env, secret) for secret in ("0" * 64, None)}
        for secret, impostor in impostors.items():
            stdout, stderr = impostor.communicate(timeout=scaled(60))
            assert impostor.returncode == 3, (secret, stdout + stderr)
            elapsed = float(stdout.split("ELAPSED ")[1].split()[0])
            assert elapsed < scaled(5.0), (secret, stdout)  # not the job's 60 s wait
            where = f"127.0.0.1:{env['MASTER_PORT']}"
            assert "JobSecretError: rank 1 on " in stdout, (secret, stdout)
            job_id = env["PHALANX_RUN_ID"]
            assert f"cannot join job {job_id!r} through its worker store at {where}" in stdout
            assert "the same PHALANX_JOB_SECRET" in stdout
        done.touch()
        rc, _, err = job.finish(timeout=120)
        assert rc == 0, err  # the job itself never noticed


def test_an_agent_needs_the_jobs_secret() -> None:
    """Two agents on this machine. Node 1 with another secret, then with none, stops at once
    naming the job and the store; then node 1 with the same secret runs the job with node 0,
    which waited all along (signed values on both nodes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = f"--nnodes 2 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port {port} "
    flags += "--rdzv-id job-under-test --rdzv-timeout 60"
    common = [*flags.split(), str(SCRIPTS / "wait_in_group.py"), "0"]
    with _job(["--node-rank", "0", *common], PHALANX_JOB_SECRET="2" * 64) as node0:
        assert node0.agent_port() == port
        for secret in ("1" * 64, None, "2" * 64):
            env = {k: v for k, v in os.environ.items() if k != "PHALANX_JOB_SECRET"}
            if secret is not None:
                env["PHALANX_JOB_SECRET"] = secret
            start = time.monotonic()
            node1 = subprocess.run(
                [*LAUNCH, "--node-rank", "1", *common],
                capture_output=True,
                text=True,
                env=env,
                timeout=scaled(90),
            )
            if secret == "2" * 64:
                assert node1.returncode == 0, node1.stderr
                rc, _, err = node0.finish(timeout=60)
                assert rc == 0, err
                return
            assert time.monotonic() - start < min(scaled(30), 59), secret  # before --rdzv-timeout
            assert node1.returncode == 1, (secret, node1.stderr)
            where = f"127.0.0.1:{port}"
            assert f"cannot join job 'job-under-test' at the rendezvous store {where}" in (
                node1.stderr
            )
            assert "set the same PHALANX_JOB_SECRET on every node" in node1.stderr


def _decoys_unchanged(directory: Path) -> list[str]:
    """What happened to the stranger's decoys: nothing, when the list is empty."""
    decoys = (directory / "decoys").read_text().split()
    wrong = []
    for decoy in map(Path, decoys):
        if not decoy.exists():
            wrong.append(f"{decoy} was unlinked")
        elif decoy.read_bytes() != b"stranger's own bytes" * 100:
            wrong.append(f"{decoy} was written")
    return wrong


# Each backend once, shm with the odd world (its segment records and unlink counter at 3 ranks),
# gloo at 2 (its keys are the store's own); the 2x2 product cost ~27 CPU-s more for no new path.
@pytest.mark.parametrize(("ranks", "backend"), [(3, "shm"), (2, "gloo")])
def test_a_stranger_racing_the_shm_keys_redirects_nothing(
    tmp_path: Path, backend: str, ranks: int
) -> None:
    """Issue 34: a stranger that writes first into every key the shm backend reads (segment
    records pointing at files of its own, replays, rank records, the old unlink counter) gets
    no rank to open, write or unlink its files, and the job finishes with the right sums."""
    ready, script = tmp_path / "ready", str(SCRIPTS / "shm_stranger_job.py")
    paths = [str(ready), str(tmp_path)]
    launcher_backend = "auto" if backend == "shm" else backend  # auto: shm on one machine
    args = ["--standalone", "--nproc-per-node", str(ranks), "--backend", launcher_backend]
    with _job([*args, script, str(ready)]) as job:
        stranger = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "shm_stranger.py"), str(job.agent_port()), "90", *paths],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            rc, out, err = job.finish(timeout=180)
            forged, stranger_err = stranger.communicate(timeout=scaled(120))
            assert ready.exists(), stranger_err
            wrong = _decoys_unchanged(tmp_path)
        finally:
            stranger.kill()
            for decoy in (tmp_path / "decoys").read_text().split() if ready.exists() else []:
                if decoy.startswith("/dev/shm/"):
                    Path(decoy).unlink(missing_ok=True)  # the stranger's own, checked above
    assert rc == 0, err
    total = sum(range(1, ranks + 1)) * (ranks if backend == "shm" else 1)
    assert f"RESULT {backend} {[float(total)] * 3}" in out, out + err
    assert "Traceback" not in err, err
    if backend == "shm":
        assert any(k.endswith("phalanx_shm/made") for k in forged.split()), forged
    assert not wrong, wrong
