"""Pure pieces of the communication layer: fingerprints and the pickle-free object codec."""

from __future__ import annotations

import pytest
import torch
from torch.distributed import ReduceOp

from phalanx.comm import codec
from phalanx.diagnostics import fingerprint


def _fp(
    op: str = "all_reduce", shape: tuple[int, ...] = (4,), dtype=torch.float32, red=ReduceOp.SUM
):  # type: ignore[no-untyped-def]
    return fingerprint.make(op, "0", 7, torch.zeros(shape, dtype=dtype), red, None, True, "f.py:3")


def test_equal_fingerprints_match() -> None:
    assert not fingerprint.mismatch({0: _fp(), 1: _fp(), 2: _fp()})


def test_shape_mismatch_message_groups_ranks_and_names_field() -> None:
    seen = {0: _fp(), 1: _fp(shape=(8,)), 2: _fp()}
    assert fingerprint.mismatch(seen)
    msg = fingerprint.mismatch_message(2, "0", 7, seen)
    assert "[rank 2] collective #7" in msg
    assert "ranks [0, 2]: all_reduce(shape=[4], dtype=float32, op=SUM) at f.py:3" in msg
    assert "rank 1: all_reduce(shape=[8]" in msg
    assert "differing: shape." in msg


def test_op_mismatch_suggests_skipped_collective() -> None:
    seen = {0: _fp(), 1: _fp(op="barrier")}
    msg = fingerprint.mismatch_message(0, "0", 7, seen)
    assert "differing: op" in msg and "skipped" in msg


def test_call_site_is_not_compared() -> None:
    a, b = _fp(), _fp()
    b["site"] = "other.py:9"
    assert not fingerprint.mismatch({0: a, 1: b})


@pytest.mark.parametrize(
    "obj",
    [
        None,
        3,
        -2.5,
        "ünï",
        b"\x00\xff",
        [1, (2, 3), {4}],
        {"a": {"b": [None, True]}},
        {(1, 2): "tuple key", 3: "int key"},
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.tensor(1.5, dtype=torch.bfloat16),
        torch.empty(0, 3, dtype=torch.int64),
        torch.tensor([True, False]),
    ],
)
def test_codec_round_trips(obj: object) -> None:
    back = codec.decode(codec.encode(obj))
    if isinstance(obj, torch.Tensor):
        assert isinstance(back, torch.Tensor) and back.dtype == obj.dtype
        assert torch.equal(back, obj)
    else:
        assert back == obj and type(back) is type(obj)


def test_codec_refuses_arbitrary_objects_by_name() -> None:
    class Secret:
        pass

    with pytest.raises(TypeError, match="Secret"):
        codec.encode({"x": Secret()})


def test_codec_decodes_no_code() -> None:
    with pytest.raises(ValueError, match="unknown tag"):
        codec.decode(b'{"p": "cos\\nsystem\\n"}')
