"""Pure parts of the launcher: flags, worker env, failure summary, commands (the agent protocol:
``test_rendezvous.py``)."""

from __future__ import annotations

import sys

import pytest

from phalanx.comm.netif import interface_for
from phalanx.launch.args import ArgsError, LaunchConfig, parse_args
from phalanx.launch.run import _warn_if_loopback
from phalanx.launch.summary import Failure, format_summary, last_exception_line
from phalanx.launch.worker_env import JobContext, Placement, worker_env
from phalanx.launch.workers import worker_command


def test_defaults_match_torchrun() -> None:
    cfg = parse_args(["train.py"], environ={})
    assert cfg == LaunchConfig(nproc_per_node=1, master_port=0, script="train.py")
    # One node without --master-port: a free port, as torchrun (which then uses c10d on :0).
    assert (cfg.master_addr, cfg.master_port, cfg.max_restarts) == ("127.0.0.1", 0, 0)
    assert parse_args(["--nnodes", "2", "x.py"], environ={}).master_port == 29500
    assert (cfg.monitor_interval, cfg.rdzv_timeout) == (0.1, 300.0)


def test_script_arguments_are_not_parsed_by_the_launcher() -> None:
    cfg = parse_args(["--nproc_per_node=2", "train.py", "--nnodes", "3", "-m", "--lr=1"])
    assert cfg.nproc_per_node == 2 and cfg.nnodes == 1
    assert cfg.script_args == ("--nnodes", "3", "-m", "--lr=1")


def test_underscore_and_dash_spellings() -> None:
    argv = [
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--master_addr",
        "h",
        "--master_port",
        "1234",
        "--max_restarts",
        "3",
        "x.py",
    ]
    cfg = parse_args(argv)
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (2, 1, "h", 1234)
    assert cfg.max_restarts == 3


def test_module_and_no_python() -> None:
    cfg = parse_args(["-m", "pkg.train", "a"])
    assert cfg.module and cfg.script == "pkg.train" and cfg.script_args == ("a",)
    assert parse_args(["--no-python", "/bin/echo", "hi"]).no_python
    with pytest.raises(ArgsError, match="cannot be combined"):
        parse_args(["-m", "--no-python", "x"])


def test_standalone_is_loopback_with_os_port() -> None:
    cfg = parse_args(["--standalone", "--master-addr", "10.0.0.1", "x.py"])
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (1, 0, "127.0.0.1", 0)
    with pytest.raises(ArgsError, match="--standalone"):
        parse_args(["--standalone", "--nnodes", "2", "x.py"])


@pytest.mark.parametrize(
    ("endpoint", "host", "port"),
    [
        ("h:123", "h", 123),
        ("h", "h", 29500),
        ("[::1]:77", "::1", 77),
        ("10.1.2.3:9", "10.1.2.3", 9),
    ],
)
def test_rdzv_endpoint_overrides_master(endpoint: str, host: str, port: int) -> None:
    cfg = parse_args(["--master-addr", "m", "--master-port", "1", "--rdzv-endpoint", endpoint, "x"])
    assert (cfg.master_addr, cfg.master_port) == (host, port)


def test_rdzv_backend_static_and_c10d_accepted_others_rejected() -> None:
    assert parse_args(["--rdzv-backend", "c10d", "--rdzv-id", "r", "x"]).rdzv_id == "r"
    with pytest.raises(ArgsError, match="--rdzv-backend 'etcd'"):
        parse_args(["--rdzv-backend", "etcd", "x"])


def test_nnodes_range_with_equal_bounds_is_fixed() -> None:
    assert parse_args(["--nnodes", "3:3", "--node-rank", "2", "x"]).nnodes == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc-per-node", "0"], "--nproc-per-node 0 is invalid"),
        (["--nproc-per-node", "-2"], "--nproc-per-node -2 is invalid"),
        (["--nproc-per-node", "two"], "--nproc-per-node 'two' is not one of auto, cpu, gpu"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is invalid with --nnodes 2"),
        (["--master-port", "70000"], "--master-port 70000 is outside the valid port range"),
        (["--master-port", "0"], "--master-port 0 is outside"),
        (["--rdzv-endpoint", "h:x"], "--rdzv-endpoint 'x' is not a port"),
        (["--backend", "foo"], "--backend 'foo' is not one of auto, gloo, nccl, mpi, shm"),
        (["--nnodes", "3:2"], "--nnodes 3:2: MIN=3 is larger than MAX=2"),
        (["--monitor-interval", "0"], "--monitor-interval 0 is invalid"),
        (["--rdzv-timeout", "soon"], "--rdzv-timeout 'soon' is not a number"),
        (["--max-restarts", "-1"], "--max-restarts -1 is invalid"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_values_name_flag_and_value(argv: list[str], message: str) -> None:
    with pytest.raises(ArgsError) as info:
        parse_args([*argv, "x.py"])
    assert message in str(info.value)


def test_missing_script() -> None:
    with pytest.raises(ArgsError, match="missing the script"):
        parse_args(["--nproc-per-node", "2"])


def test_nproc_auto_is_resolved_as_torchrun_does() -> None:
    def probe(counts: dict[str, int | None]) -> object:
        return lambda kind: counts.get(kind)

    cpu_only = probe({"cpu": 6})
    with_gpus = probe({"cpu": 6, "gpu": 4, "accelerator": 4})
    assert parse_args(["--nproc-per-node", "auto", "x"], probe=cpu_only).nproc_per_node == 6
    assert parse_args(["--nproc-per-node", "auto", "x"], probe=with_gpus).nproc_per_node == 4
    assert parse_args(["--nproc-per-node", "cpu", "x"], probe=with_gpus).nproc_per_node == 6
    assert parse_args(["--nproc-per-node", "gpu", "x"], probe=with_gpus).nproc_per_node == 4
    with pytest.raises(ArgsError, match="--nproc-per-node gpu: CUDA is not available"):
        parse_args(["--nproc-per-node", "gpu", "x"], probe=cpu_only)


def _env(base: dict[str, str], restart: int = 0) -> dict[str, str]:
    place = Placement(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1, nnodes=2)
    job = JobContext("10.0.0.1", 4242, restart, 3, "run9", backend="gloo", gloo_ifname="eth7")
    return worker_env(base, place, job)


def test_worker_env_contract() -> None:
    env = _env({"PATH": "/bin", "RANK": "stale"}, restart=2)
    assert env["PATH"] == "/bin"
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
    }
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["ROLE_NAME"]) == ("1", "2", "default")
    assert (env["ROLE_RANK"], env["ROLE_WORLD_SIZE"]) == ("5", "8")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "4242")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["TORCHELASTIC_RESTART_COUNT"] == env["PHALANX_RESTART_COUNT"] == "2"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert env["TORCHELASTIC_RUN_ID"] == env["PHALANX_RUN_ID"] == "run9"
    assert (env["PHALANX_BACKEND"], env["PYTHONUNBUFFERED"]) == ("gloo", "1")
    assert (env["OMP_NUM_THREADS"], env["GLOO_SOCKET_IFNAME"]) == ("1", "eth7")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def test_worker_env_keeps_user_threads_and_interface() -> None:
    env = _env({"OMP_NUM_THREADS": "7", "GLOO_SOCKET_IFNAME": "ib0"})
    assert (env["OMP_NUM_THREADS"], env["GLOO_SOCKET_IFNAME"]) == ("7", "ib0")


def test_omp_threads_rule_is_torchruns() -> None:
    """1 thread per worker when several share the node and the user set none; else untouched."""
    job = JobContext("h", 1, 0, 0, "r")
    one = Placement(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, nnodes=1)
    assert "OMP_NUM_THREADS" not in worker_env({}, one, job)
    assert _env({})["OMP_NUM_THREADS"] == "1"


def test_worker_command() -> None:
    assert worker_command("t.py", ["a"], False, False) == [sys.executable, "-u", "t.py", "a"]
    assert worker_command("p.m", [], True, False) == [sys.executable, "-u", "-m", "p.m"]
    assert worker_command("/bin/echo", ["hi"], False, True) == ["/bin/echo", "hi"]


def test_last_exception_line_of_the_last_traceback() -> None:
    lines = [
        "Traceback (most recent call last):\n",
        '  File "a.py", line 1, in <module>\n',
        "KeyError: 'first'\n",
        "\n",
        "During handling of the above exception, another exception occurred:\n",
        "[rank0]: Traceback (most recent call last):\n",
        '[rank0]:   File "a.py", line 3, in <module>\n',
        "[rank0]:     raise ValueError('boom')\n",
        "[rank0]: ValueError: boom\n",
        "some later output\n",
    ]
    assert last_exception_line(lines) == "ValueError: boom"
    assert last_exception_line(["no traceback here"]) is None


def test_failure_round_trip_and_summary() -> None:
    failure = Failure(3, 1, 1, 4321, -9, exception="RuntimeError: x")
    assert Failure.from_json(failure.to_json().encode()) == failure
    assert failure.exit_code == 137
    text = "\n".join(format_summary(failure, 0, 0))
    assert "rank 3 failed (local rank 1 on node 1, pid 4321): signal SIGKILL" in text
    assert "exception: RuntimeError: x" in text
    assert Failure(0, 0, 0, 1, 2).exit_code == 2


def test_interface_for_loopback() -> None:
    found = interface_for("127.0.0.1")
    assert found is not None and found[1] == "127.0.0.1"
    assert interface_for("no-such-host.invalid") is None


def test_multi_node_master_on_loopback_warns(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse_args(["--nnodes", "2", "--master-addr", "myhost", "x.py"])
    _warn_if_loopback(cfg, ["127.0.1.1"])
    assert "resolves to 127.0.1.1 here, a loopback address" in capsys.readouterr().err
    _warn_if_loopback(cfg, ["10.0.0.5"])
    _warn_if_loopback(parse_args(["x.py"]), ["127.0.0.1"])
    assert capsys.readouterr().err == ""


def test_elastic_node_range() -> None:
    cfg = parse_args(["--nnodes", "1:2", "--node-rank", "1", "--master-addr", "h", "x.py"])
    assert (cfg.min_nodes, cfg.nnodes, cfg.node_rank) == (1, 2, 1)
    assert parse_args(["--nnodes", "3", "--master-addr", "h", "x.py"]).min_nodes == 0  # fixed
