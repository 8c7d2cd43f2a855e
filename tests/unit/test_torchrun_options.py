"""``phalanx run`` accepts every option of the installed torchrun, each with torchrun's meaning.

The walk reads torch's own parser (``torch.distributed.run.get_args_parser()``), so an option
that a future torch adds fails here until phalanx gives it a meaning.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from phalanx.launch import run
from phalanx.launch.args import ArgsError, LaunchConfig, parse_args
from phalanx.launch.nproc import MAX_ENV

Check = Callable[[LaunchConfig], bool]
TWO = ["--nproc-per-node", "2"]
USR1, HUP = signal.SIGUSR1, signal.SIGHUP

# torchrun's dest -> (a plausible value or None for a flag, other flags it needs, its meaning)
MEANING: dict[str, tuple[str | None, list[str], Check]] = {
    "nnodes": ("1:2", [], lambda c: (c.min_nodes, c.nnodes) == (1, 2)),
    "nproc_per_node": ("3", [], lambda c: c.nproc_per_node == 3),
    "rdzv_backend": ("c10d", [], lambda c: c.rdzv_backend == "c10d"),
    "rdzv_endpoint": ("h:1234", [], lambda c: (c.master_addr, c.master_port) == ("h", 1234)),
    "rdzv_id": ("job9", [], lambda c: c.rdzv_id == "job9"),
    "rdzv_conf": ("join_timeout=77", [], lambda c: c.rdzv_timeout == 77),
    "standalone": (None, [], lambda c: c.standalone and c.master_port == 0),
    "max_restarts": ("2", [], lambda c: c.max_restarts == 2),
    "monitor_interval": ("0.5", [], lambda c: c.monitor_interval == 0.5),
    "start_method": ("fork", [], lambda c: c.start_method == "fork"),
    "event_log_handler": ("console", [], lambda c: c.event_log_handler == "console"),
    "role": ("trainer", [], lambda c: c.role == "trainer"),
    "module": (None, [], lambda c: c.module),
    "no_python": (None, [], lambda c: c.no_python),
    "run_path": (None, [], lambda c: c.run_path),
    "log_dir": ("/tmp/logs", [], lambda c: c.logs.log_dir == "/tmp/logs"),
    "redirects": ("3", [], lambda c: c.logs.redirects.of(0) == 3),
    "tee": ("0:1", TWO, lambda c: (c.logs.tee.of(0), c.logs.tee.of(1)) == (1, 0)),
    "local_ranks_filter": ("1", TWO, lambda c: c.logs.local_ranks_filter == {1}),
    "duplicate_stdout_filters": ("a,,b", [], lambda c: c.logs.duplicate_stdout_filters == ("a,b",)),
    "duplicate_stderr_filters": ("x", [], lambda c: c.logs.duplicate_stderr_filters == ("x",)),
    "node_rank": ("1", ["--nnodes", "2"], lambda c: c.node_rank == 1),
    "master_addr": ("10.0.0.1", [], lambda c: c.master_addr == "10.0.0.1"),
    "master_port": ("1234", [], lambda c: c.master_port == 1234),
    "local_addr": ("127.0.0.1", [], lambda c: c.local_addr == "127.0.0.1"),
    "logs_specs": ("mine", [], lambda c: c.logs.logs_specs == "mine"),
    "numa_binding": ("socket", [], lambda c: c.numa_binding == "socket"),
    "signals_to_handle": ("SIGUSR1,SIGHUP", [], lambda c: c.signals_to_handle == (USR1, HUP)),
    "shutdown_timeout": ("7", [], lambda c: c.shutdown_timeout == 7.0),
    "virtual_local_rank": (None, [], lambda c: c.virtual_local_rank),
}


def _probe(kind: str) -> int | None:
    return {"cpu": 4, "gpu": 2, "accelerator": 2}.get(kind)


@pytest.fixture(autouse=True)
def _numactl(monkeypatch: pytest.MonkeyPatch) -> None:
    """--numa-binding needs the numactl command; pretend it is installed."""
    monkeypatch.setattr("phalanx.launch.args.shutil.which", lambda name: f"/usr/bin/{name}")


def _options() -> list[tuple[str, object]]:
    skip = ("help", "training_script", "training_script_args")
    return [(a.dest, a) for a in get_args_parser()._actions if a.dest not in skip]


def test_every_torchrun_option_has_a_meaning_here() -> None:
    missing = [a.option_strings for dest, a in _options() if dest not in MEANING]
    assert missing == [], f"torchrun options phalanx run does not know: {missing}"


@pytest.mark.parametrize(("dest", "action"), _options(), ids=[d for d, _ in _options()])
def test_each_spelling_is_accepted_with_torchruns_meaning(dest: str, action: object) -> None:
    value, extra, meaning = MEANING[dest]
    for option in action.option_strings:  # type: ignore[attr-defined]
        argv = [option, *([] if value is None else [value]), *extra, "x.py"]
        get_args_parser().parse_args(argv)  # the same line is valid for torchrun
        cfg = parse_args(argv, environ={}, probe=_probe)
        assert meaning(cfg), f"{argv} was accepted but does not mean what it means in torchrun"


@pytest.mark.parametrize(("dest", "action"), _options(), ids=[d for d, _ in _options()])
def test_pet_environment_defaults_like_torchrun(dest: str, action: object) -> None:
    """torchrun's ``env`` / ``check_env`` options take their default from PET_<DEST>."""
    if type(action).__name__ not in ("env", "check_env"):
        pytest.skip(f"torchrun reads no PET_ variable for {dest}")
    value, extra, meaning = MEANING[dest]
    environ = {f"PET_{dest.upper()}": "1" if value is None else value}
    assert meaning(parse_args([*extra, "x.py"], environ=environ, probe=_probe))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rdzv-backend", "etcd"], "--rdzv-backend 'etcd' is not one of static, c10d"),
        (["--rdzv-backend", "etcd-v2"], "phalanx runs its own rendezvous"),
        (["--rdzv-conf", "last_call_timeout=5"], "--rdzv-conf last_call_timeout=5 cannot be"),
        (["--rdzv-conf", "read_timeout=5"], "--rdzv-conf read_timeout=5 cannot be honoured"),
        (["--rdzv-conf", "is_host=1", "--nnodes", "2", "--node-rank", "1"], "is_host=1"),
        (["--rdzv-conf", "rank=3"], "--rdzv-conf rank=3 cannot be honoured: it contradicts"),
        (["--rdzv-conf", "oops"], "'oops' is not of the form KEY=VALUE"),
        (["--rdzv-conf", "timeout=9", "--rdzv-timeout", "8"], "given twice, differently"),
        (["--start-method", "thread"], "--start-method 'thread' is not one of spawn"),
        (["--event-log-handler", "kafka"], "--event-log-handler 'kafka' is not one of"),
        (["--numa-binding", "nodes"], "--numa-binding 'nodes' is not one of node, socket"),
        (["--signals-to-handle", "SIGFOO"], "'SIGFOO' is not a signal name"),
        (["--signals-to-handle", "SIGKILL"], "SIGKILL cannot be caught"),
        (["--redirects", "4"], "--redirects '4' is not 0 (none), 1 (stdout)"),
        (["--tee", "0:3,2:1", "--nproc-per-node", "2"], "--tee 0:3,2:1 names local rank 2"),
        (["--local-ranks-filter", "0,x"], "--local-ranks-filter '0,x' is not a comma-separated"),
        (["--local-ranks-filter", "3"], "names local rank 3, but this node runs local ranks 0..0"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout -1 is invalid"),
        (["-m", "--run-path"], "-m/--module and --run-path cannot be combined"),
        (["--role", ""], "--role '' is empty"),
        (["--nproc-per-node", "tpu"], "--nproc-per-node 'tpu' is not one of auto, cpu, gpu"),
    ],
)
def test_values_torchrun_would_misread_or_phalanx_cannot_honour(
    argv: list[str], message: str
) -> None:
    with pytest.raises(ArgsError) as info:
        parse_args([*argv, "x.py"], environ={}, probe=_probe)
    assert message in str(info.value)


def test_gpu_options_need_gpus() -> None:
    cpu_only = {"cpu": 4}.get
    with pytest.raises(ArgsError, match="--numa-binding node binds local rank i to the CPUs"):
        parse_args(["--numa-binding", "node", "x.py"], environ={}, probe=cpu_only)
    env = {"CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(ArgsError, match="--virtual-local-rank gives local rank i the i-th"):
        parse_args(["--virtual-local-rank", "--nproc-per-node", "2", "x.py"], env, cpu_only)


def test_shutdown_timeout_default_and_torch_variable() -> None:
    assert parse_args(["x.py"], environ={}).shutdown_timeout == 3.0
    env = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "12"}
    assert parse_args(["x.py"], environ=env).shutdown_timeout == 12.0
    assert parse_args(["--shutdown-timeout", "1", "x.py"], environ=env).shutdown_timeout == 1.0


def test_python_exec_and_run_path_precedence() -> None:
    cfg = parse_args(["--run-path", "--no-python", "x.py"], environ={"PYTHON_EXEC": "/py"})
    assert (cfg.python, cfg.run_path, cfg.no_python) == ("/py", True, False)


def test_c10d_endpoint_without_port_uses_torchruns_c10d_port() -> None:
    cfg = parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "x.py"], environ={})
    assert (cfg.master_addr, cfg.master_port) == ("h", 29400)
    assert parse_args(["--rdzv-endpoint", "h", "x.py"], environ={}).master_port == 29500


@pytest.mark.parametrize("value", ["100000", "65"])
def test_nproc_cap_fails_before_any_process_starts(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("phalanx.launch.nproc._cpu_count", lambda: 2)
    monkeypatch.delenv(MAX_ENV, raising=False)

    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr("subprocess.Popen", no_process)
    assert run.main(["--nproc-per-node", value, "x.py"]) == 2
    err = capsys.readouterr().err
    assert f"--nproc-per-node {value} is more workers than this machine can run" in err
    assert "the limit here is 32 (8 workers per usable CPU (8 x 2), at least 32" in err
    assert f"set {MAX_ENV} to raise the limit" in err


def test_nproc_cap_can_be_raised() -> None:
    cfg = parse_args(["--nproc-per-node", "40", "x.py"], environ={MAX_ENV: "64"})
    assert cfg.nproc_per_node == 40


def test_log_dir_that_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_text("")
    with pytest.raises(ArgsError, match=f"--log-dir {file} is a file"):
        parse_args(["--log-dir", str(file), "x.py"], environ={})


def test_prefix_template_from_torchruns_variable() -> None:
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${role_name}${local_rank}]:"}
    assert parse_args(["x.py"], environ=env).logs.prefix_template == "[${role_name}${local_rank}]:"
