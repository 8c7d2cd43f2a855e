"""The plain-data unpickler: every protocol's plain values, nothing that imports or calls."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from phalanx.comm.plain_pickle import UnsafePickleError, loads_plain


def test_plain_pickle_reads_plain_data_of_every_protocol() -> None:
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        value: dict[str, Any] = {"a": [1, 2.5, None, True, "x", (1,), (1, 2), (1, 2, 3), ()]}
        value |= {"big": 2**80, "u": "é" * 300, "empty": ({}, [], (1, 2, 3, 4))}
        if protocol >= 3:
            value["b"] = b"bytes"
        if protocol >= 4:
            value |= {"s": {1, 2}, "f": frozenset({3})}
        value["again"] = value["a"]
        out = loads_plain(pickle.dumps(value, protocol=protocol))
        assert out == value and out["again"] is out["a"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x80\x02}q\x00(X", "not enough data"),
        (b"", "exhausted before seeing STOP"),
        (b"\x80\x02]K\x01K\x02s.", "expected a dict on the stack, found list"),
        (b"\x80\x02}]K\x01s.", "unhashable type"),
        (b"\x80\x02ccopy_reg\n_reconstructor\nq\x00.", "opcode GLOBAL at byte 2"),
    ],
)
def test_plain_pickle_names_what_is_wrong(data: bytes, why: str) -> None:
    with pytest.raises(UnsafePickleError, match=f"^bad.pkl: .*{why}"):
        loads_plain(data, "bad.pkl")


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_code_in_any_protocol_is_refused_before_it_runs(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps({"entries": [1, _Payload(marker)]}, protocol=protocol)
    with pytest.raises(UnsafePickleError, match=r"^f: refused to unpickle: opcode \w*GLOBAL"):
        loads_plain(data, "f")
    assert not marker.exists()
