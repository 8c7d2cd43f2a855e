"""The `phalanx` command's dispatch and `phalanx doctor`."""

from __future__ import annotations

import json
import socket

import pytest

from phalanx import cli, doctor
from phalanx.comm import backends


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
    names = {"torch", "backends", "shm", "default", "gpus", "interfaces", "route", "hostname"}
    assert names | {"port"} <= set(checks)
    assert checks["route"]["status"] == "ok" and "via lo" in checks["route"]["detail"]
    assert checks["port"]["status"] == "fail" and str(port) in checks["port"]["detail"]
    assert code == 1


def test_doctor_rejects_bad_port() -> None:
    with pytest.raises(SystemExit) as exc:
        doctor.main(["--master-port", "70000"])
    assert exc.value.code == 2


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
    assert doctor._default_backend_check().detail == (
        "backend shm when every rank runs on this machine, shm across machines that each run "
        "2 or more (hierarchical, under phalanx run), else gloo; --backend / PHALANX_BACKEND "
        "choose another"
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
    assert doctor._default_backend_check().detail == "gloo (PHALANX_BACKEND=gloo is set)"


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
    assert doctor._default_backend_check().detail.startswith(
        "backend gloo when every rank runs on this machine (CPU ranks on one machine, but shm "
        "cannot run on Darwin on arm64)"
    )


def test_doctor_probes_this_machine_for_real() -> None:
    assert doctor._memfd() is None  # Linux with /proc: a memfd opens again through /proc
    why, free = doctor._dev_shm()
    assert why is None and free > 0
