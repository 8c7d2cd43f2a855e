"""Log files of ``phalanx run``: the layout equals torch's ``DefaultLogsSpecs`` for every form."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std

from phalanx.launch import checks
from phalanx.launch.config import LogOptions
from phalanx.launch.logs import AttemptLogs, RunLogs, StreamLogs, from_logs_dest, plan_attempt

NPROC = 3
REDIRECTS = ["0", "1", "2", "3", "0:3,2:1"]
TEES = ["0", "1", "3", "1:2"]
FILTERS = ["", "0", "1,2"]


def _options(redirects: str, tee: str, ranks: str, log_dir: str | None) -> LogOptions:
    return LogOptions(
        log_dir=log_dir,
        redirects=checks.std_spec("--redirects", redirects, NPROC),
        tee=checks.std_spec("--tee", tee, NPROC),
        local_ranks_filter=checks.rank_set("--local-ranks-filter", ranks, NPROC),
        duplicate_stdout_filters=("loss",),
    )


def _relative(plan: AttemptLogs, root: str) -> AttemptLogs:
    """The plan with every path relative to the attempt folder ``root``."""

    def rel(path: str | None) -> str | None:
        return None if path is None else os.path.relpath(path, root)

    def stream(s: StreamLogs) -> StreamLogs:
        return StreamLogs(rel(s.file), s.console, s.filtered)

    workers = tuple(
        type(w)(stream(w.stdout), stream(w.stderr), rel(w.error_file) or "") for w in plan.workers
    )
    return AttemptLogs(
        workers,
        rel(plan.filtered_stdout),
        rel(plan.filtered_stderr),
        plan.stdout_filters,
        plan.stderr_filters,
    )


@pytest.mark.parametrize(
    ("redirects", "tee", "ranks"), list(itertools.product(REDIRECTS, TEES, FILTERS))
)
def test_layout_equals_torchs_default_logs_specs(
    redirects: str, tee: str, ranks: str, tmp_path: Path
) -> None:
    options = _options(redirects, tee, ranks, str(tmp_path))
    torch_specs = DefaultLogsSpecs(
        log_dir=str(tmp_path),
        redirects=Std.from_str(redirects),
        tee=Std.from_str(tee),
        local_ranks_filter={int(r) for r in ranks.split(",")} if ranks else None,
    )
    envs = {
        r: {"TORCHELASTIC_RUN_ID": "run", "TORCHELASTIC_RESTART_COUNT": "2"} for r in range(NPROC)
    }
    dest = torch_specs.reify(envs)
    theirs = from_logs_dest(dest, NPROC, options)
    torch_attempt = os.path.dirname(dest.filtered_stdout)
    assert os.path.basename(torch_attempt) == "attempt_2"
    ours = plan_attempt(options, "A/attempt_2", NPROC)
    assert _relative(ours, "A/attempt_2") == _relative(theirs, torch_attempt)


def test_dev_null_log_dir_is_torchs_too() -> None:
    options = LogOptions(log_dir=os.devnull, redirects=checks.std_spec("-r", "3", NPROC))
    envs = {r: {"TORCHELASTIC_RUN_ID": "run"} for r in range(NPROC)}
    dest = DefaultLogsSpecs(log_dir=os.devnull, redirects=Std.ALL).reify(envs)
    assert (
        from_logs_dest(dest, NPROC, options).workers == plan_attempt(options, None, NPROC).workers
    )


def test_run_logs_folders_error_files_and_cleanup(tmp_path: Path) -> None:
    said: list[str] = []
    options = LogOptions(log_dir=str(tmp_path), tee=checks.std_spec("-t", "3", 2))
    logs = RunLogs(options, said.append)
    envs: list[dict[str, str]] = [{}, {}]
    plan = logs.attempt("job", 1, envs)
    run_dir = next(tmp_path.iterdir())
    assert run_dir.name.startswith("job_")
    assert envs[1]["TORCHELASTIC_ERROR_FILE"] == str(run_dir / "attempt_1" / "1" / "error.json")
    assert plan.workers[0].stdout == StreamLogs(str(run_dir / "attempt_1/0/stdout.log"), True, True)
    assert (run_dir / "attempt_1" / "1").is_dir()
    assert said == [f"worker logs of attempt 1 in {run_dir / 'attempt_1'}"]
    logs.close()
    assert run_dir.exists()  # a --log-dir is never removed

    quiet = RunLogs(LogOptions(), said.append)
    quiet.attempt("job", 0, [{}])
    temp = quiet._temp_base
    assert temp is not None and os.path.isdir(temp)
    quiet.close()
    assert not os.path.exists(temp)  # only error-file folders were there
