"""gloo's interface (issue 35, point 6): one decision, made by ``phalanx run`` for its workers
and by ``phalanx.init_process_group`` where another launcher (torchrun) made none."""

from __future__ import annotations

import os

import pytest

from phalanx.comm import group
from phalanx.comm.env import discover_env
from phalanx.comm.group import pin_gloo_interface
from phalanx.comm.init_method import InitMethod
from phalanx.comm.netif import gloo_interface, interface_for
from phalanx.launch.args import parse_args
from phalanx.launch.attempt import gloo_interface as launcher_interface

LOOPBACK = interface_for("127.0.0.1")
assert LOOPBACK is not None
LO = LOOPBACK[0]


@pytest.fixture(autouse=True)
def _no_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GLOO_SOCKET_IFNAME at the start, and none left behind by what a test pins."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # recorded, so that teardown restores
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")


def test_the_interface_routes_to_the_master_or_owns_the_local_address() -> None:
    assert gloo_interface({}, "127.0.0.1") == LO
    assert gloo_interface({}, "no-such-host.invalid", local_addr="127.0.0.1") == LO
    assert gloo_interface({}, "no-such-host.invalid") is None  # gloo decides, as before
    assert gloo_interface({}, None) is None and gloo_interface({}, "") is None


def test_the_users_gloo_socket_ifname_wins_even_empty() -> None:
    assert gloo_interface({"GLOO_SOCKET_IFNAME": "eth7"}, "127.0.0.1") is None
    assert gloo_interface({"GLOO_SOCKET_IFNAME": ""}, "127.0.0.1") is None


def test_the_launcher_decides_through_the_same_function() -> None:
    cfg = parse_args(["--nnodes", "2", "--master-addr", "127.0.0.1", "x.py"], environ={})
    assert launcher_interface(cfg, {}) == LO
    assert launcher_interface(cfg, {"GLOO_SOCKET_IFNAME": "eth7"}) is None


def test_a_process_under_torchrun_pins_what_phalanx_run_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun sets no GLOO_SOCKET_IFNAME: gloo would resolve the host name, and fall back to
    loopback where it does not resolve. phalanx pins the interface routing to MASTER_ADDR."""
    for var, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "torchrun-job",
    }.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("PHALANX_RUN_ID", raising=False)
    env = discover_env()
    assert env.source == "torchrun"
    master = group._master_host(InitMethod("env"), env)
    assert master == "127.0.0.1"
    assert pin_gloo_interface(master, 1) == LO
    assert os.environ["GLOO_SOCKET_IFNAME"] == LO
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's own: kept
    assert pin_gloo_interface(master, 1) is None
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_where_there_is_no_master_nothing_is_pinned() -> None:
    env = discover_env()
    assert group._master_host(None, env) is None
    assert group._master_host(InitMethod("file", path="/tmp/x"), env) is None
    assert group._master_host(InitMethod("tcp", host="127.0.0.1", port=1), env) == "127.0.0.1"
    assert pin_gloo_interface(None, 0) is None
    assert "GLOO_SOCKET_IFNAME" not in os.environ
