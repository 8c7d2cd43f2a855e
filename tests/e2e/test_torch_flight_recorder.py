"""`phalanx diagnose` on torch's own Flight Recorder dumps of a real 2-rank gloo job that never
calls phalanx (examples/torch_fr_mismatch.py): rank 0 issues one all-reduce more than rank 1.

Both jobs (the mismatched one and a matched one) run at once, 4 processes started directly (no
launcher), under one deadline; a rank that exits with another code than expected kills the rest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.diagnostics import diagnose_cli as diagnose

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples" / "torch_fr_mismatch.py"
DEADLINE_S = 60
EXPECTED_RC = {"skip": 1, "ok": 0}  # the skipped all-reduce ends in gloo's timeout
TIMEOUT_S = {"skip": "2", "ok": "30"}  # a matched job never waits for one: no spurious failure


def _line_of(text: str) -> int:
    lines = JOB.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def _start(tmp: Path, mode: str, rank: int) -> subprocess.Popen[bytes]:
    out = tmp / mode
    env = {
        **os.environ,
        "TORCH_FR_BUFFER_SIZE": "200",
        "TORCH_FR_DUMP_TEMP_FILE": str(out / "pickle" / "trace_"),
    }
    cmd = [
        sys.executable,
        str(JOB),
        "--mode",
        mode,
        "--timeout",
        TIMEOUT_S[mode],
        "--json-prefix",
        str(out / "json" / "trace_"),
        "--init-method",
        f"file://{tmp}/rdv-{mode}",
        "--rank",
        str(rank),
        "--world-size",
        "2",
    ]
    (out / "json").mkdir(parents=True, exist_ok=True)
    log = (out / f"log{rank}").open("wb")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_all(procs: dict[tuple[str, int], subprocess.Popen[bytes]], tmp: Path) -> None:
    """Wait for every rank; on the first unexpected exit code, or at the deadline, kill all."""
    deadline = time.monotonic() + DEADLINE_S
    try:
        while any(p.poll() is None for p in procs.values()):
            bad = [k for k, p in procs.items() if p.poll() not in (None, EXPECTED_RC[k[0]])]
            if bad or time.monotonic() > deadline:
                logs = {k: (tmp / k[0] / f"log{k[1]}").read_text()[-2000:] for k in procs}
                pytest.fail(f"unexpected exit or past {DEADLINE_S} s: {bad}\n{logs}")
            time.sleep(0.05)
        bad = [k for k, p in procs.items() if p.returncode != EXPECTED_RC[k[0]]]
        assert not bad, f"ranks {bad} exited with unexpected codes"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("torch-fr")
    procs = {(mode, r): _start(tmp, mode, r) for mode in EXPECTED_RC for r in (0, 1)}
    _wait_all(procs, tmp)
    return tmp


def test_the_first_divergence_from_the_pickle_dumps(
    dumps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert diagnose.main([str(dumps / "skip" / "pickle")]) == 1
    out = capsys.readouterr().out
    log_metrics = f"{JOB}:{_line_of('only rank 0 calls this')} in log_metrics"
    train_step = f"{JOB}:{_line_of('def train_step') + 1} in train_step"
    assert "read torch Flight Recorder dumps of rank(s) [0, 1], with call sites" in out
    assert (
        "first divergence: collective #2 on group torch pg 1 diverges: "
        f"rank(s) [0] issued all_reduce [4, 2] float32 at {log_metrics}; "
        f"rank(s) [1] issued all_reduce [4, 2] float32 at {train_step}"
    ) in out


def test_the_json_dumps_have_no_stacks_so_the_ops_differ_later(
    dumps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = [str(dumps / "skip" / "json" / f"trace_{r}") for r in (0, 1)]
    assert diagnose.main(files) == 1
    out = capsys.readouterr().out
    assert (
        "collective #4 on group torch pg 1 diverges: rank(s) [0] issued all_reduce [4, 2] "
        "float32 at ?; rank(s) [1] issued broadcast [3] int64 at ?"
    ) in out


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_a_matched_job_has_no_divergence(
    dumps: Path, capsys: pytest.CaptureFixture[str], form: str
) -> None:
    assert diagnose.main([str(dumps / "ok" / form)]) == 0
    out = capsys.readouterr().out
    assert "no divergence" in out
    barrier = f"barrier - at {JOB}:{_line_of('dist.barrier(')} in train" if form == "pickle" else ""
    for rank in (0, 1):
        assert f"rank {rank}: 5 collectives recorded; last: {barrier}" in out
