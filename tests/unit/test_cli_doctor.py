"""The `phalanx` command's dispatch and `phalanx doctor`."""

from __future__ import annotations

import json
import socket

import pytest

from phalanx import cli, doctor


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
    assert {"torch", "backends", "gpus", "interfaces", "route", "hostname", "port"} <= set(checks)
    assert checks["route"]["status"] == "ok" and "via lo" in checks["route"]["detail"]
    assert checks["port"]["status"] == "fail" and str(port) in checks["port"]["detail"]
    assert code == 1


def test_doctor_rejects_bad_port() -> None:
    with pytest.raises(SystemExit) as exc:
        doctor.main(["--master-port", "70000"])
    assert exc.value.code == 2
