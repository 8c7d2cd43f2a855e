"""The `phalanx` command's dispatch and `phalanx doctor`."""

from __future__ import annotations

import json
import socket

import pytest

from phalanx import cli, doctor
from phalanx.comm import backends
from phalanx.launch import nproc
from phalanx.launch.backend_note import backend_note


def test_help_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "run" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert cli.main([]) == 2


def test_doctor_reports_every_check_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        code = doctor.main(["--json", "--master-port", str(port)])
    finally:
        held.close()
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    names = {"torch", "backends", "shm", "run", "gpus", "interfaces", "route", "hostname"}
    assert names | {"port"} <= set(checks)
    assert checks["route"]["status"] == "ok" and "via lo" in checks["route"]["detail"]
    assert checks["port"]["status"] == "fail" and str(port) in checks["port"]["detail"]
    assert code == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["--master-port", "70000"],
        ["--nnodes", "0"],
        ["--nproc-per-node", "x"],
        ["--backend", "tcp"],
    ],
)
def test_doctor_rejects_bad_flags(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        doctor.main(argv)
    assert exc.value.code == 2


@pytest.mark.parametrize("backend", [None, "auto", "gloo", "shm"])
@pytest.mark.parametrize(("nproc", "nnodes"), [(2, 1), (1, 1), (2, 2), (1, 2), (3, 4)])
def test_doctor_says_what_the_launchers_start_up_line_will_say(
    monkeypatch: pytest.MonkeyPatch, backend: str | None, nproc: int, nnodes: int
) -> None:
    """Issue 36, item 4: `phalanx doctor` tells what `phalanx run` will pick and why, in the
    start-up line's words, from the launcher's own decision (`workers_backend`)."""
    monkeypatch.delenv("PHALANX_BACKEND", raising=False)
    monkeypatch.setattr(doctor.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(backends, "shm_unusable", lambda: None)
    check = doctor._run_backend_check(backend, nproc, nnodes)
    prefix = f"phalanx run --nproc-per-node {nproc} --nnodes {nnodes}: "
    assert check.name == "run" and check.detail.startswith(prefix)
    said = check.detail.removeprefix(prefix)
    # what the launcher prints for that job: every node runs nproc, so the fewest is nproc
    line = backend_note(backend, nproc * nnodes, nproc, fewest_local=nproc).removeprefix(", ")
    if backend in (None, "auto"):
        assert said == line
    else:  # named: the start-up line's words, and who named it
        named = f"backend {backend} (--backend {backend}"
        assert said.startswith(named) and line.startswith(f"backend {backend}")
    auto = {(2, 1): "shm", (1, 1): "gloo", (2, 2): "shm", (1, 2): "gloo", (3, 4): "shm"}
    picked = said.split(" (")[0].split()[-1]
    assert picked == (auto[nproc, nnodes] if backend in (None, "auto") else backend)


def test_doctor_on_a_gpu_machine_and_through_the_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PHALANX_BACKEND", raising=False)
    monkeypatch.setattr(nproc, "gpu_build", lambda: True)  # a CUDA build of torch, with a GPU
    monkeypatch.setattr(doctor.torch.cuda, "is_available", lambda: True)
    assert doctor._run_backend_check().detail == "default backend nccl (GPU ranks)"
    monkeypatch.setattr(doctor.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(backends, "shm_unusable", lambda: None)
    assert cli.main(["doctor", "--json", "--nproc-per-node", "2", "--backend", "GLOO"]) in (0, 1)
    (run,) = [c for c in json.loads(capsys.readouterr().out) if c["name"] == "run"]
    assert (
        run["detail"] == "phalanx run --nproc-per-node 2 --nnodes 1: backend gloo (--backend gloo)"
    )


def test_doctor_says_whether_shm_can_run_and_what_a_job_gets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 35, point 5: shm, the single-machine default, is reported with what it needs."""
    monkeypatch.delenv("PHALANX_BACKEND", raising=False)
    monkeypatch.setattr(doctor.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor, "shm_unusable", lambda: None)
    monkeypatch.setattr(backends, "shm_unusable", lambda: None)
    monkeypatch.setattr(doctor, "_memfd", lambda: None)
    monkeypatch.setattr(doctor, "_dev_shm", lambda: (None, 64 * 2**30))
    shm = doctor._shm_check()
    assert shm.status == "ok" and shm.detail.startswith("usable: segments are memfds")
    assert "/dev/shm writable, 65536 MiB free" in shm.detail
    assert doctor._run_backend_check().detail == (
        "default backend shm (CPU ranks on one machine; --backend gloo opts out); across "
        "machines: shm when each runs 2 or more (hierarchical: shared memory inside each "
        "machine, gloo between them; measured faster than gloo across machines), else gloo"
    )
    monkeypatch.setattr(doctor, "_memfd", lambda: "memfd_create failed: Operation not permitted")
    monkeypatch.setattr(doctor, "_dev_shm", lambda: (None, 32 * 2**20))
    small = doctor._shm_check()
    assert (
        small.status == "warn" and "32 MiB free (docker run --shm-size raises it)" in small.detail
    )
    monkeypatch.setattr(doctor, "_dev_shm", lambda: ("/dev/shm does not exist", 0))
    assert doctor._shm_check() == doctor.Check(
        "shm",
        "fail",
        "not usable: memfd_create failed: Operation not permitted, and /dev/shm does not exist; "
        "pass --backend gloo (PHALANX_BACKEND=gloo)",
    )
    monkeypatch.setenv("PHALANX_BACKEND", "gloo")
    assert doctor._run_backend_check().detail == "backend gloo (PHALANX_BACKEND is gloo)"


def test_doctor_where_shm_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_BACKEND", raising=False)
    monkeypatch.setattr(doctor.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor, "shm_unusable", lambda: "Darwin on arm64")
    monkeypatch.setattr(backends, "shm_unusable", lambda: "Darwin on arm64")
    check = doctor._shm_check()
    assert (check.status, check.detail) == (
        "warn",
        "cannot run on Darwin on arm64: CPU ranks use gloo",
    )
    assert doctor._run_backend_check().detail == (
        "default backend gloo (CPU ranks on one machine, but shm cannot run on Darwin on "
        "arm64); gloo across machines too"
    )
    refused = doctor._run_backend_check("shm", 2)  # phalanx run refuses it before starting
    assert (refused.status, refused.detail) == (
        "fail",
        "phalanx run --nproc-per-node 2 --nnodes 1: backend shm (--backend shm: shared memory: "
        "every rank on this machine); refused: shm cannot run on Darwin on arm64",
    )


def test_doctor_probes_this_machine_for_real() -> None:
    assert doctor._memfd() is None  # Linux with /proc: a memfd opens again through /proc
    why, free = doctor._dev_shm()
    assert why is None and free > 0
