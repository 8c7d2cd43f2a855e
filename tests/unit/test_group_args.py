"""init_process_group's argument checking and the single-process world, in one process."""

from __future__ import annotations

import socket

import pytest

import phalanx
from phalanx.comm.group import resolve_backend
from phalanx.comm.store import bind_listener


def test_resolve_backend() -> None:
    assert resolve_backend(None, 0) == "gloo"  # no GPU on CI
    assert resolve_backend("GLOO", 0) == "gloo"
    with pytest.raises(ValueError, match="backend='foo'"):
        resolve_backend("foo", 0)


def test_world_before_init_is_single_process() -> None:
    w = phalanx.world()
    assert (w.rank, w.world_size, w.is_main) == (0, 1, True)
    assert phalanx.is_main() and not phalanx.is_initialized()


def test_single_process_group_and_context_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    import torch

    with phalanx.process_group(timeout=5) as w:
        assert (w.rank, w.world_size, w.backend) == (0, 1, "gloo")
        t = torch.ones(3)
        phalanx.all_reduce(t, algorithm="ring")
        assert t.tolist() == [1.0, 1.0, 1.0]
        with phalanx.main_first():
            pass
        with pytest.raises(RuntimeError, match="called twice"):
            phalanx.init_process_group()
    assert not phalanx.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_method": "udp://x:1"}, "unknown scheme 'udp'"),
        ({"init_method": "tcp://nohostport"}, "tcp://HOST:PORT"),
        ({"rank": 3, "world_size": 2}, "rank=3 is outside 0..1"),
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"timeout": -1}, "timeout must be a positive number"),
        ({"backend": "carrier-pigeon"}, "carrier-pigeon"),
        ({"init_method": "env://", "world_size": 2, "rank": 0}, "MASTER_ADDR"),
    ],
)
def test_bad_arguments_name_the_argument(
    kwargs: dict[str, object], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=match):
        phalanx.init_process_group(**kwargs)  # type: ignore[arg-type]
    assert not phalanx.is_initialized()


def test_bind_listener_names_port_in_use() -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 is already in use"):
            bind_listener("127.0.0.1", port)
    finally:
        held.close()


def test_bind_listener_binds_only_the_given_address() -> None:
    sock = bind_listener("127.0.0.1", 0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()
    with pytest.raises(OSError, match="not an address of this machine"):
        bind_listener("192.0.2.254", 0)
