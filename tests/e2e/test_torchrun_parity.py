"""``phalanx run`` next to a real torchrun, in the same test: same environment, files, console.

Each case runs the same script under ``python -m torch.distributed.run`` and under
``python -m phalanx.launch``, side by side, and compares what the workers saw and wrote.
torchrun prefixes tee'd lines with ``[default0]:`` where phalanx writes ``[rank 0] ``;
everything else must match.
"""

from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path

import pytest

from tests.e2e.launching import SCRIPTS, run_ok_together, worker_envs

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PHALANX = [sys.executable, "-m", "phalanx.launch"]

pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_worker_environment_matches_torchrun() -> None:
    flags = ["--nproc-per-node", "2", "--rdzv-id", "parity", "--role", "trainer"]
    script = str(SCRIPTS / "show_env.py")
    ports = [str(_free_port()), str(_free_port())]
    theirs, ours = (
        worker_envs(out)
        for out, _ in run_ok_together(
            [*TORCHRUN, *flags, "--master-port", ports[0], script],
            [*PHALANX, *flags, "--master-port", ports[1], script],
        )
    )
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
    theirs, ours = run_ok_together(
        [*TORCHRUN, *flags, "--log-dir", str(tmp_path / "t"), *module],
        [*PHALANX, *flags, "--log-dir", str(tmp_path / "p"), *module],
    )
    files = _files(tmp_path / "p")
    assert files == _files(tmp_path / "t")
    assert sorted(files) == [f"attempt_0/{r}/{s}.log" for r in (0, 1) for s in ("stderr", "stdout")]
    assert files["attempt_0/1/stdout.log"] == "out from 1\npartial 1 done\n"
    assert _console(ours[0]) == _console(theirs[0])
    assert _console(ours[0]) == [("0", "out from 0"), ("0", "partial 0 done")]
    assert _console(ours[1]) == _console(theirs[1]) == [("0", "err from 0")]


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
    theirs, ours = (
        shown(out) for out, _ in run_ok_together([*TORCHRUN, *flags], [*PHALANX, *flags])
    )
    assert ours == theirs
    assert ours["argv"] == ["a", "--b"] and ours["name"] == "__main__"


def test_redirects_tee_filters_prefix_template_and_restarts_as_torchrun(tmp_path: Path) -> None:
    """stderr to files only, stdout tee'd, 'loss' lines duplicated, one restart: same files."""
    flags = [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--role",
        "w",
        "--redirects",
        "2",
        "--tee",
        "1",
        "--duplicate-stdout-filters",
        "loss",
    ]
    script = str(SCRIPTS / "chatty.py")
    template = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${role_name}${local_rank}]:"}
    theirs, ours = run_ok_together(
        [*TORCHRUN, *flags, "--log-dir", str(tmp_path / "t"), script],
        [*PHALANX, *flags, "--log-dir", str(tmp_path / "p"), script],
        **template,
    )

    def unordered(files: dict[str, str]) -> dict[str, object]:
        # the ranks race to the shared filtered file, under torchrun as under phalanx
        return {k: sorted(v.splitlines()) if "filtered" in k else v for k, v in files.items()}

    files = _files(tmp_path / "p")
    assert unordered(files) == unordered(_files(tmp_path / "t"))
    filtered = sorted(files["attempt_1/filtered_stdout.log"].splitlines())
    assert filtered == [f"[w{r}]:loss 0.5 rank {r} attempt 1" for r in (0, 1)]
    assert files["attempt_0/1/stderr.log"] == "warn rank 1\n"

    def shown(text: str) -> list[str]:
        return sorted(line for line in text.splitlines() if line.startswith("[w"))

    assert shown(ours[0]) == shown(theirs[0])
    assert len(shown(ours[0])) == 8  # 2 lines x 2 ranks x 2 attempts
    assert shown(ours[1]) == shown(theirs[1]) == []  # stderr went to the files only
