"""The examples run under `phalanx run` exactly as the README shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.testing import scaled
from tests.e2e.launching import standalone

ROOT = Path(__file__).resolve().parents[2]


def _start(script: str, *args: str, nproc: int = 2, cwd: Path = ROOT) -> subprocess.Popen[str]:
    cmd = [
        *standalone(nproc),
        str(ROOT / "examples" / script),
        *args,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)


def _stdout(proc: subprocess.Popen[str]) -> str:
    try:
        out, err = proc.communicate(timeout=scaled(240))
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err
    return out


def _launch(script: str, *args: str, nproc: int = 2, cwd: Path = ROOT) -> str:
    return _stdout(_start(script, *args, nproc=nproc, cwd=cwd))


def test_p2p_pingpong() -> None:
    out = _launch("p2p_pingpong.py")
    assert "[rank 0] after recv, rank 0 has data 2" in out
    assert "[rank 1] after recv, rank 1 has data 1" in out
    assert "[rank 1] isend/irecv round trip: rank 1 has data 12" in out


def test_collectives_on_2_and_3_ranks() -> None:
    """The two jobs side by side: each launcher starts its workers after its own start-up."""
    procs = {nproc: _start("collectives.py", nproc=nproc) for nproc in (2, 3)}
    try:
        outs = {nproc: _stdout(proc) for nproc, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    for nproc, out in outs.items():
        total = float(sum(range(1, nproc + 1)))
        assert f"[rank 0] reduce SUM to 0          rank 0: {total}" in out
        for algorithm in ("native", "ring", "tree"):
            expected = [float(nproc * i + sum(range(nproc))) for i in range(5)]
            for r in range(nproc):
                line = f"[rank {r}] all_reduce SUM ({algorithm})".ljust(33)
                assert line + f" rank {r}: {expected}" in out, (nproc, out)


def test_seed001_toy_ddp() -> None:
    out = _launch("toy_ddp.py")
    assert "(rank = 0, local_rank = 0) loss =" in out and "(rank = 1, local_rank = 1) loss =" in out


def test_seed002_cifar10_main(tmp_path: Path) -> None:
    out = _launch("cifar10_ddp.py", "--epochs", "2", "--ckpt-dir", str(tmp_path))
    losses = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "mean loss" in line]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.ckpt", "1.ckpt"]


def test_seed004_mnist_started_by_hand_over_tcp() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = str(ROOT / "examples" / "mnist.py")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                script,
                "--init-method",
                f"tcp://127.0.0.1:{port}",
                "--rank",
                str(r),
                "--world-size",
                "3",
                "--epochs",
                "4",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(3)
    ]
    try:
        outs = [p.communicate(timeout=scaled(180))[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    last = [line for line in outs[0].splitlines() if "test accuracy" in line][-1]
    assert float(last.rsplit(" ", 1)[1].rstrip("%")) >= 90.0, outs[0]


def test_digits_demo_reaches_97_percent_and_resumes(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    out = _launch("digits.py", "--checkpoint-dir", ckpt)
    done = next(line for line in out.splitlines() if "done: test accuracy" in line)
    assert float(done.split("test accuracy ")[1].split("%")[0]) >= 97.0, out
    assert "samples/s" in done and "waiting for communication" in done
    again = _launch("digits.py", "--checkpoint-dir", ckpt)
    assert "nothing left to train" in again


@pytest.mark.parametrize(
    "args",
    [
        ("--strategy", "ssp", "--staleness", "2", "--straggler", "1:2"),
        pytest.param(("--strategy", "ps-async"), marks=pytest.mark.extended),
    ],
)
def test_digits_demo_on_a_parameter_server(args: tuple[str, ...], tmp_path: Path) -> None:
    out = _launch("digits.py", *args, "--epochs", "4", nproc=3, cwd=tmp_path)
    done = next(line for line in out.splitlines() if "done: test accuracy" in line)
    assert float(done.split("test accuracy ")[1].split("%")[0]) >= 90.0, out
    applied = int(done.split("server applied ")[1].split()[0])
    assert applied == 2 * 4 * 23  # every batch of both workers' shards, applied once
    assert "staleness histogram {" in done and "lost workers none" in done
