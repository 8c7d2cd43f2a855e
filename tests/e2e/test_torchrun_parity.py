"""``phalanx run`` next to a real torchrun, in the same test: same environment, files, console.

Each case runs the same script under ``python -m torch.distributed.run`` and under
``python -m phalanx.launch`` and compares what the workers saw and wrote. torchrun prefixes
tee'd lines with ``[default0]:`` where phalanx writes ``[rank 0] ``; everything else must match.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PHALANX = [sys.executable, "-m", "phalanx.launch"]
DEADLINE_S = 90

pytestmark = pytest.mark.timeout(240)


def _env() -> dict[str, str]:
    drop = ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PET_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """Run a launcher in its own process group; on the deadline kill the group and fail."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**_env(), **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"{cmd} did not finish in {DEADLINE_S} s:\n{out}\n{err}")
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{out}\n{err}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _envs(stdout: str) -> dict[str, dict[str, str]]:
    """The ENV line of each worker, by its RANK."""
    found = [json.loads(line.split("ENV ", 1)[1]) for line in stdout.splitlines() if "ENV " in line]
    return {env["RANK"]: env for env in found}


def test_worker_environment_matches_torchrun() -> None:
    flags = ["--nproc-per-node", "2", "--rdzv-id", "parity", "--role", "trainer"]
    script = str(SCRIPTS / "show_env.py")
    theirs = _envs(_run([*TORCHRUN, *flags, "--master-port", str(_free_port()), script]).stdout)
    ours = _envs(_run([*PHALANX, *flags, "--master-port", str(_free_port()), script]).stdout)
    assert sorted(theirs) == sorted(ours) == ["0", "1"]
    differ = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}  # a fresh worker store; a temp dir
    for rank in ("0", "1"):
        missing = sorted(set(theirs[rank]) - set(ours[rank]))
        assert missing == [], f"torchrun sets {missing} for its workers, phalanx does not"
        same = {k: theirs[rank][k] for k in theirs[rank] if k not in differ}
        assert {k: ours[rank][k] for k in same} == same
        tail = f"attempt_0/{rank}/error.json"
        assert theirs[rank]["TORCHELASTIC_ERROR_FILE"].endswith(tail)
        assert ours[rank]["TORCHELASTIC_ERROR_FILE"].endswith(tail)
    # torch._dynamo's import (through `import phalanx` in the launcher) sets the inductor cache
    # directory to the default each worker would compute for itself.
    ours_only = {"PYTHONUNBUFFERED", "GLOO_SOCKET_IFNAME", "TORCHINDUCTOR_CACHE_DIR"}
    extra = set(ours["0"]) - set(theirs["0"]) - ours_only
    assert all(k.startswith("PHALANX_") for k in extra), extra


def _files(log_dir: Path) -> dict[str, str]:
    """Every file under the single run folder of ``log_dir``, relative to it, with its text."""
    (run_dir,) = log_dir.iterdir()
    files = sorted(p for p in run_dir.rglob("*") if p.is_file())
    return {str(p.relative_to(run_dir)): p.read_text() for p in files}


_WORKER_LINE = re.compile(r"^(\[default(\d+)\]:|\[rank (\d+)\] )(.*)$")


def _console(text: str) -> list[tuple[str, str]]:
    """(rank, text) of the worker lines on a console, whichever launcher prefixed them."""
    found = []
    for line in text.splitlines():
        match = _WORKER_LINE.match(line)
        if match:
            found.append((match.group(2) or match.group(3), match.group(4)))
    return sorted(found)


def test_log_dir_tee_and_ranks_filter_with_a_module_as_torchrun(tmp_path: Path) -> None:
    flags = ["--standalone", "--nproc-per-node", "2", "--tee", "3", "--local-ranks-filter", "0"]
    module = ["-m", "tests.e2e.scripts.echo_streams"]
    theirs = _run([*TORCHRUN, *flags, "--log-dir", str(tmp_path / "t"), *module])
    ours = _run([*PHALANX, *flags, "--log-dir", str(tmp_path / "p"), *module])
    files = _files(tmp_path / "p")
    assert files == _files(tmp_path / "t")
    assert sorted(files) == [f"attempt_0/{r}/{s}.log" for r in (0, 1) for s in ("stderr", "stdout")]
    assert files["attempt_0/1/stdout.log"] == "out from 1\npartial 1 done\n"
    assert _console(ours.stdout) == _console(theirs.stdout)
    assert _console(ours.stdout) == [("0", "out from 0"), ("0", "partial 0 done")]
    assert _console(ours.stderr) == _console(theirs.stderr) == [("0", "err from 0")]


@pytest.mark.parametrize(
    "how",
    [
        ["-m", "tests.e2e.scripts.show_argv"],
        ["--run-path", str(SCRIPTS / "show_argv.py")],
        ["--no-python", sys.executable, str(SCRIPTS / "show_argv.py")],
    ],
    ids=["module", "run-path", "no-python"],
)
def test_module_run_path_and_no_python_start_the_script_as_torchrun(how: list[str]) -> None:
    def shown(stdout: str) -> dict[str, object]:
        return dict(json.loads(stdout.split("ARGV ", 1)[1].splitlines()[0]))

    flags = ["--standalone", "--nproc-per-node", "1", *how, "a", "--b"]
    theirs, ours = shown(_run([*TORCHRUN, *flags]).stdout), shown(_run([*PHALANX, *flags]).stdout)
    assert ours == theirs
    assert ours["argv"] == ["a", "--b"] and ours["name"] == "__main__"


def test_redirects_tee_filters_prefix_template_and_restarts_as_torchrun(tmp_path: Path) -> None:
    """stderr to files only, stdout tee'd, 'loss' lines duplicated, one restart: same files."""
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--role", "w",
             "--redirects", "2", "--tee", "1", "--duplicate-stdout-filters", "loss"]  # fmt: skip
    script = str(SCRIPTS / "chatty.py")
    template = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${role_name}${local_rank}]:"}
    theirs = _run([*TORCHRUN, *flags, "--log-dir", str(tmp_path / "t"), script], **template)
    ours = _run([*PHALANX, *flags, "--log-dir", str(tmp_path / "p"), script], **template)
    files = _files(tmp_path / "p")
    assert files == _files(tmp_path / "t")
    filtered = sorted(files["attempt_1/filtered_stdout.log"].splitlines())
    assert filtered == [f"[w{r}]:loss 0.5 rank {r} attempt 1" for r in (0, 1)]
    assert files["attempt_0/1/stderr.log"] == "warn rank 1\n"

    def shown(text: str) -> list[str]:
        return sorted(line for line in text.splitlines() if line.startswith("[w"))

    assert shown(ours.stdout) == shown(theirs.stdout)
    assert len(shown(ours.stdout)) == 8  # 2 lines x 2 ranks x 2 attempts
    assert shown(ours.stderr) == shown(theirs.stderr) == []  # stderr went to the files only
