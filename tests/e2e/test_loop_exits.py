"""How training scripts end: the README's Quick start file, no ``close()``, a SIGTERM.

Each runs under the real launcher (``phalanx run``), in a process group of its own that the
deadline kills. None of them may lose the last checkpoint.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.e2e.launching import DEADLINE_S, ROOT, SCRIPTS, finish, launcher_env, standalone

LOOP_EXIT = str(SCRIPTS / "loop_exit.py")
STEPS_PER_EPOCH = 8  # loop_exit.py: 256 samples, 2 ranks x 16 per batch


QUICK_START = ROOT / "examples" / "quickstart.py"
"""The README's Quick start, which the README includes verbatim (tests/docs/test_readme.py)."""


def _launch(cwd: Path, *cmd: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*standalone(2), *cmd],
        cwd=cwd,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _run(cwd: Path, *cmd: str) -> tuple[int, str]:
    proc = _launch(cwd, *cmd)
    out, err = finish(proc)
    return proc.returncode, out + err


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the launcher's workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _digest(output: str) -> str:
    return next(line.split()[-1] for line in output.splitlines() if "DIGEST" in line)


def test_the_readme_quick_start_commits_its_last_checkpoint_and_a_rerun_trains_nothing(
    tmp_path: Path,
) -> None:
    """The newcomer's first two runs: the first trains, the second resumes with nothing left."""
    code, output = _run(tmp_path, str(QUICK_START))  # its checkpoints go to ./ckpt
    assert code == 0, output
    # 1024 samples, 2 ranks x 64 a batch, 4 micro-steps a step: 2 steps an epoch, 10 epochs.
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-000020", output
    metrics = (tmp_path / "ckpt" / "metrics.jsonl").read_text()
    code, again = _run(tmp_path, str(QUICK_START))
    assert code == 0, again
    assert "resumed from" in again and "(step 20, epoch 10)" in again, again
    assert (tmp_path / "ckpt" / "metrics.jsonl").read_text() == metrics  # nothing trained
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-000020"


class Preempted(NamedTuple):
    """The SIGTERM scenario's three runs (see :func:`preempted`)."""

    stopped: str  # the preempted run's output
    step: int  # the step its SIGTERM committed
    latest: str  # its checkpoint directory's "latest" then, before the rerun
    epochs: int  # of the two later runs
    resumed: tuple[int, str]  # exit code, output
    clean: tuple[int, str]
    clean_ckpt: Path


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> Preempted:
    """A job of 1000 epochs stopped by SIGTERM after step 5; then, side by side, the rerun that
    resumes it and a clean run of as many epochs in a fresh directory. Those two, like every
    run of loop_exit.py, end without ``job.close()``."""
    tmp = tmp_path_factory.mktemp("sigterm")
    ckpt, stamp = tmp / "preempted", tmp / "stamp"
    # Only the SIGTERM ends it. The launcher passes the signal on to its workers (as SLURM
    # signals every task) and waits up to --shutdown-timeout for them.
    proc = _launch(
        tmp,
        "--shutdown-timeout",
        "60",
        LOOP_EXIT,
        str(ckpt),
        "1000",
        "--stamp",
        str(stamp),
        "--stamp-step",
        "5",
    )
    deadline = time.monotonic() + DEADLINE_S
    while not stamp.exists():
        assert proc.poll() is None, finish(proc)
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no step 5 within {DEADLINE_S} s: {finish(proc)}")
        time.sleep(0.05)
    # As SLURM does: every process of the job gets SIGTERM, and the launcher passes its own on,
    # so each worker gets two, milliseconds apart.
    for pid in [*_children(proc.pid), proc.pid]:
        os.kill(pid, signal.SIGTERM)
    out, err = finish(proc)
    output = out + err
    assert proc.returncode == 128 + signal.SIGTERM, output
    stopped = re.search(r"SIGTERM: step (\d+) committed", output)
    assert stopped is not None, output
    step, latest = int(stopped.group(1)), (ckpt / "latest").read_text().strip()
    epochs = step // STEPS_PER_EPOCH + 2
    runs = [_launch(tmp, LOOP_EXIT, str(where), str(epochs)) for where in (ckpt, tmp / "clean")]
    try:
        outputs = ["".join(finish(p)) for p in runs]
        resumed, clean = [(p.returncode, output) for p, output in zip(runs, outputs)]
    finally:
        for p in runs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate(timeout=10)
    return Preempted(output, step, latest, epochs, resumed, clean, tmp / "clean")


def test_sigterm_commits_the_last_step_and_the_rerun_resumes_bit_identically(
    preempted: Preempted,
) -> None:
    step = preempted.step
    assert step >= 5 and preempted.latest == f"step-{step:06d}", preempted.stopped
    # Resumed, it ends as a run never interrupted: same parameters, bit for bit.
    code, resumed = preempted.resumed
    assert code == 0 and f"(step {step}," in resumed, resumed
    code, clean = preempted.clean
    assert code == 0, clean
    assert _digest(resumed) == _digest(clean)


def test_a_script_without_close_commits_its_last_asynchronous_save(
    preempted: Preempted,
) -> None:
    """The clean run of the SIGTERM scenario: it saves asynchronously after its last epoch
    and ends without ``job.close()``."""
    code, output = preempted.clean
    assert code == 0, output
    last = preempted.epochs * STEPS_PER_EPOCH
    assert (preempted.clean_ckpt / "latest").read_text().strip() == f"step-{last:06d}", output
    assert f"waiting for checkpoint step {last}" in output  # said, not silent


def test_save_on_sigterm_false_keeps_the_default_action(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(
        "import os, signal, phalanx\n"
        "job = phalanx.Job('ddp', checkpoint_dir='ckpt', save_on_sigterm=False)\n"
        "print('DEFAULT', signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)\n"
        "job.close()\n"
        "job = phalanx.Job('ddp', checkpoint_dir='ckpt')\n"
        "print('CAUGHT', signal.getsignal(signal.SIGTERM) != signal.SIG_DFL, flush=True)\n"
        "job.close()\n"
        "print('RESTORED', signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)\n"
    )
    code, output = _run(tmp_path, str(script))
    assert code == 0, output
    for word in ("DEFAULT", "CAUGHT", "RESTORED"):
        assert output.count(f"{word} True") == 2, output
