"""The plain-data unpickler: every protocol's plain values, nothing that imports or calls."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from phalanx.diagnostics.plain_pickle import UnsafePickleError, loads_plain
from tests.unit.pickle_bytes import child_reports, get, put, shared


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
        (b"\x80\x02]K\x01K\x02s.", "expected a dict on the stack, found a list of 0 items"),
        (b"\x80\x02}]K\x01s.", "a dict key that is a list of 0 items"),
        (b"\x80\x02ccopy_reg\n_reconstructor\nq\x00.", r"opcode GLOBAL would .* \(at byte 2\)"),
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


# ---- crafted plain data: 2**40 values in a few hundred bytes, deep nesting, cycles -----------
# Each row runs in one child process, timed on its CPU clock (a busy machine stretches wall
# time, not CPU time), the child under a wall-clock deadline: a row that hangs in C code (a
# hash) fails the test instead of hanging it.

CPU_LIMIT_S = 1.0
"""CPU seconds a row may take (the machine refuses each in milliseconds)."""
WALL_LIMIT_S = 120.0
"""Wall seconds for the whole child (a hung row never ends; its imports take a few)."""


def _u(text: str) -> bytes:
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _in_dict(key: bytes, value: bytes) -> bytes:
    """``{"entries": [{key: value}]}``, as a Flight Recorder dump would hold it (protocol 2)."""
    return b"\x80\x02}" + _u("entries") + b"]}" + key + value + b"sas."


ROWS: dict[str, tuple[bytes, str]] = {
    "dict key: a 40-level shared tuple": (
        _in_dict(shared(40, "tuple"), b"K\x01"),
        "counting shared references",
    ),
    "dict value: a 40-level shared list": (
        _in_dict(_u("frames"), shared(40, "list")),
        "counting shared references",
    ),
    "set item: a 40-level shared tuple": (
        b"\x80\x04\x8f(" + shared(40, "tuple") + b"\x90.",
        "counting shared references",
    ),
    "200,000 lists deep": (b"\x80\x02" + b"]" * 200_000 + b"a" * 199_999 + b".", "deeper than 100"),
    "200,000 tuples deep": (b"\x80\x02)" + b"\x85" * 200_000 + b".", "deeper than 100"),
    "200,000 dicts deep": (
        b"\x80\x02" + (b"}" + _u("k")) * 200_000 + b"N" + b"s" * 200_000 + b".",
        "deeper than 100",
    ),
    "a list that holds itself": (b"\x80\x02]" + put(0) + get(0) + b"a.", "second reference"),
    "a shared dict filled later": (
        b"\x80\x02}" + put(0) + b"]" + get(0) + b"a0" + _u("k") + b"Ns.",
        "items added to a dict after a second reference",
    ),
    "a 1 MB string 100,000 times": (
        b"\x80\x02" + _u("x" * 1_000_000) + put(0) + b"0](" + get(0) * 100_000 + b"e.",
        "counting shared references",
    ),
    "dict key: an int of 80,000 bits": (
        _in_dict(b"\x8b" + (10_000).to_bytes(4, "little") + b"\x01" * 10_000, b"N"),
        "a dict key that is an int of 79993 bits",
    ),
    "dict key: a nested tuple": (
        _in_dict(b"K\x01\x85\x85", b"N"),
        "a dict key that is a tuple of 1 items",
    ),
}
"""Row -> (the crafted pickle, a piece of the message that shows which bound refused it)."""


def _child() -> None:
    for name, (data, _) in ROWS.items():
        start = time.process_time()
        try:
            loads_plain(data, "crafted.pkl")
            error, message = "", ""
        except Exception as exc:  # the parent checks which
            error, message = type(exc).__name__, str(exc)
        cpu = time.process_time() - start
        print(json.dumps({"name": name, "error": error, "message": message, "cpu_s": cpu}))


@pytest.fixture(scope="module")
def crafted() -> tuple[dict[str, dict[str, Any]], str]:
    return child_reports("tests.unit.test_plain_pickle", "--child", limit_s=WALL_LIMIT_S)


@pytest.mark.parametrize("row", list(ROWS))
def test_crafted_plain_data_is_refused_quickly(
    crafted: tuple[dict[str, dict[str, Any]], str], row: str
) -> None:
    reports, stderr = crafted
    assert row in reports, f"{row}: no report: the machine hung or died on it\n{stderr}"
    report = reports[row]
    assert report["error"] == "UnsafePickleError", report
    message = report["message"]
    assert message.startswith("crafted.pkl: ") and ROWS[row][1] in message, message
    assert len(message) < 500, message  # types and sizes, never a repr of the structure
    assert report["cpu_s"] < CPU_LIMIT_S, f"{row}: {report['cpu_s']:.2f} CPU seconds"


def test_sharing_within_the_bounds_is_kept() -> None:
    frame = {"name": "step", "filename": "/job/train.py" * 10, "line": 10}
    doc = {"entries": [{"frames": [frame] * 40, "key": ("a", 1, None)} for _ in range(50)]}
    out: Any = loads_plain(pickle.dumps(doc, protocol=2))
    assert out == doc
    assert out["entries"][0]["frames"][0] is out["entries"][1]["frames"][39]


# ---- torch's own Flight Recorder dump, as a job with a deep stack writes it -----------------

_DUMP_JOB = """
import os, sys
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
def nested(depth, t):
    if depth:
        return nested(depth - 1, t)
    for i in range(300):
        dist.all_reduce(t) if i % 3 else dist.broadcast(t, 0)
nested(40, torch.ones(4))
with open(sys.argv[2], "wb") as f:
    f.write(_dump_fr_trace())
dist.destroy_process_group()
"""


def test_a_real_flight_recorder_dump_reads_as_pickle_reads_it(tmp_path: Path) -> None:
    dump = tmp_path / "trace_0"
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "2000"}
    command = [sys.executable, "-c", _DUMP_JOB, f"file://{tmp_path}/rdv", str(dump)]
    subprocess.run(command, env=env, check=True, timeout=WALL_LIMIT_S, capture_output=True)
    data = dump.read_bytes()
    out: Any = loads_plain(data, str(dump))
    assert out == pickle.loads(data)  # the test's own file: trusted
    entries = out["entries"]
    assert len(entries) == 300 and len(entries[1]["frames"]) > 40
    # torch's pickler shares each frame dict among the entries: kept, and within the bounds
    assert entries[1]["frames"][0] is entries[2]["frames"][0]


if __name__ == "__main__" and sys.argv[1:] == ["--child"]:
    _child()
