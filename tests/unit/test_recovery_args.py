"""Bad input to live recovery fails at once, naming the argument, the value and the fix."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from phalanx.recovery import LiveGroup
from phalanx.recovery.startup import read_env


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"member_id": ""}, "member_id must be a slot id"),
        ({"member_id": "0/1"}, "member_id must be a slot id"),
        ({"incarnation": -1}, "incarnation must be an int >= 0, got -1"),
        ({"timeout": 0}, "timeout must be a positive number of seconds, got 0"),
        ({"backend": "nccl"}, "backend='nccl' is not supported yet.*pass backend='gloo'"),
        ({"heartbeat_timeout": -2.0}, "heartbeat_timeout must be"),
        ({"rank": 3, "world_size": 2}, "rank in 0..world_size-1, got rank=3, world_size=2"),
    ],
)
def test_live_group_refuses_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"member_id": "0.0", "incarnation": 0, "rank": 0, "world_size": 1}
    args.update(kwargs)
    store = dist.HashStore()
    with pytest.raises(ValueError, match=match):
        LiveGroup(store, join_timeout=1.0, heartbeat_interval=0.05, **args)  # type: ignore[arg-type]


def test_from_env_names_the_missing_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_MEMBER_ID", raising=False)
    with pytest.raises(ValueError, match=r"PHALANX_MEMBER_ID is not set.*--recovery live"):
        read_env(timeout=1.0)
    monkeypatch.setenv("PHALANX_MEMBER_ID", "0.1")
    monkeypatch.setenv("PHALANX_INCARNATION", "one")
    with pytest.raises(ValueError, match="PHALANX_INCARNATION='one'"):
        read_env(timeout=1.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"store": "127.0.0.1:29500"}, r"store must be a torch.distributed.Store.*got store="),
        ({"secret": "ab" * 32}, r"secret must be bytes .*got str"),
    ],
)
def test_live_group_names_a_store_or_secret_of_the_wrong_type(
    kwargs: dict[str, object], match: str
) -> None:
    args: dict[str, object] = {"store": dist.HashStore(), "member_id": "0.0", "incarnation": 0}
    args.update(kwargs)
    with pytest.raises(TypeError, match=match) as caught:
        LiveGroup(rank=0, world_size=1, join_timeout=1.0, **args)  # type: ignore[arg-type]
    assert "ab" * 32 not in str(caught.value)  # the secret itself is never printed
