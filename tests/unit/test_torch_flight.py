"""torch Flight Recorder dumps read by `phalanx diagnose`: NCCL-shaped dumps built here (same
schema as torch 2.13 writes, nothing downloaded), the plain-data unpickler, refused pickles."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from phalanx.diagnostics import diagnose_cli as diagnose
from phalanx.diagnostics.dumps import read_dumps
from phalanx.diagnostics.flight import FlightRecorder
from phalanx.diagnostics.plain_pickle import UnsafePickleError
from phalanx.diagnostics.torch_flight import read_torch_dump

T0 = 1_795_000_000_000_000_000  # ns since the epoch, as torch's c10::getTime() gives
TORCH_FRAMES = [
    {"name": "ncclGroupEnd", "filename": "/pytorch/torch/csrc/ProcessGroupNCCL.cpp", "line": 9},
    {"name": "all_reduce", "filename": "/venv/torch/distributed/distributed_c10d.py", "line": 2},
    {"name": "wrapper", "filename": "/venv/torch/distributed/c10d_logger.py", "line": 83},
]


def _entry(
    seq: int, op: str, size: list[int], dtype: str, site: tuple[str, int], **kw: Any
) -> dict[str, Any]:
    frames = [*TORCH_FRAMES, {"name": site[0], "filename": "/job/train.py", "line": site[1]}]
    frames.append({"name": "<module>", "filename": "/job/train.py", "line": 99})
    entry = {
        "record_id": seq,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"nccl:{op}",
        "time_created_ns": T0 + seq * 1000,
        "input_sizes": [size],
        "input_dtypes": [dtype],
        "output_sizes": [size],
        "output_dtypes": [dtype],
        "state": "completed",
        "time_discovered_started_ns": T0 + seq * 1000 + 10,
        "time_discovered_completed_ns": T0 + seq * 1000 + 500,
        "retired": True,
        "timeout_ms": 600000,
        "is_p2p": False,
        "thread_id": "1",
        "thread_name": "python",
        "duration_ms": 0.4,
        "frames": frames,
    }
    return {**entry, **kw}


def _nccl_dump(rank: int) -> dict[str, Any]:
    """Rank 0 calls the third all-reduce with bf16, rank 1 with float32: a dtype mismatch."""
    send = _entry(1, f"send {rank}->{1 - rank}", [8], "Float", ("pipe", 20), is_p2p=True)
    send["p2p_seq_id"] = 1
    last_dtype = "BFloat16" if rank == 0 else "Float"
    unfinished = {"state": "started", "time_discovered_completed_ns": None, "retired": False}
    entries = [
        _entry(1, "all_reduce", [1024], "Float", ("step", 10)),
        send,
        _entry(2, "_allgather_base", [2, 64], "Half", ("gather", 30)),
        _entry(3, "all_reduce", [1024], last_dtype, ("sync", 40 + rank), **unfinished),
    ]
    return {
        "version": "2.10",
        "comm_lib_version": "2.27.5",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "pg_status": {
            "0": {
                "last_enqueued_collective": 3,
                "last_started_collective": 3,
                "last_completed_collective": 2,
            }
        },
        "nccl_comm_state": {},
        "entries": entries,
    }


def _as_json(doc: dict[str, Any]) -> bytes:
    """torch's JSON form: no frames, 0 for unknown times."""
    entries = [{k: v for k, v in e.items() if k != "frames"} for e in doc["entries"]]
    for e in entries:
        e["time_discovered_completed_ns"] = e["time_discovered_completed_ns"] or 0
    return json.dumps({**doc, "entries": entries}).encode()


def _write_nccl(tmp: Path, form: str = "pickle") -> None:
    for rank in (0, 1):
        doc = _nccl_dump(rank)
        data = pickle.dumps(doc, protocol=2) if form == "pickle" else _as_json(doc)
        (tmp / f"nccl_trace_rank_{rank}").write_bytes(data)


def test_nccl_pickle_dump_reads_as_records(tmp_path: Path) -> None:
    _write_nccl(tmp_path)
    dump = read_torch_dump(tmp_path / "nccl_trace_rank_0")
    assert dump.rank == 0 and dump.has_frames and dump.backends == {"nccl"}
    assert [(r.group, r.seq, r.op, r.shape) for r in dump.records] == [
        ("torch pg 0 (default_pg)", 1, "all_reduce", "[1024] float32"),
        ("torch pg 0 (default_pg)", 2, "_allgather_base", "[2, 64] float16"),
        ("torch pg 0 (default_pg)", 3, "all_reduce", "[1024] bfloat16"),
    ]  # the send is left out
    first, last = dump.records[0], dump.records[-1]
    assert first.site == "/job/train.py:10 in step"  # past the C++ and torch frames
    assert first.start == pytest.approx((T0 + 1000) / 1e9)
    assert first.end == pytest.approx((T0 + 1500) / 1e9)
    assert last.end is None  # started, never completed


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_diagnose_names_the_nccl_dtype_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], form: str
) -> None:
    _write_nccl(tmp_path, form)
    assert diagnose.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "collective #3 on group torch pg 0 (default_pg) diverges" in out
    site0, site1 = ("/job/train.py:40 in sync", "/job/train.py:41 in sync")
    if form == "json":
        site0 = site1 = "?"
        assert "without call sites" in out
    assert f"rank(s) [0] issued all_reduce [1024] bfloat16 at {site0}" in out
    assert f"rank(s) [1] issued all_reduce [1024] float32 at {site1}" in out
    assert "(#3 on group torch pg 0 (default_pg), in flight)" in out
    assert "gloo" not in out


def test_files_named_on_the_command_line(tmp_path: Path) -> None:
    _write_nccl(tmp_path)
    files = [str(tmp_path / f"nccl_trace_rank_{r}") for r in (0, 1)]
    assert diagnose.main(files) == 1
    assert diagnose.main(files[:1]) == 0  # one rank alone cannot diverge


def test_a_json_dump_beside_a_pickle_one_compares_no_call_sites(tmp_path: Path) -> None:
    (tmp_path / "trace_0").write_bytes(pickle.dumps(_nccl_dump(0), protocol=2))
    (tmp_path / "trace_1").write_bytes(_as_json(_nccl_dump(0)))  # the same calls, no stacks
    records, notes = read_dumps([tmp_path])
    assert {r.site for recs in records.values() for r in recs} == {"?"}
    assert "without call sites" in notes[0]
    assert diagnose.main([str(tmp_path)]) == 0


def test_phalanx_and_torch_dumps_of_one_job_are_merged(tmp_path: Path) -> None:
    _write_nccl(tmp_path)
    for rank in (0, 1):
        fr = FlightRecorder()
        fr.start("0", 1, "broadcast", "[4] float32", "a.py:3 in g")
        fr.finish("0", 1)
        fr.dump(tmp_path / f"rank-{rank}.json", rank)
    (tmp_path / "rdv").write_bytes(b"\x00\x01 rendezvous")  # neither kind: passed over
    (tmp_path / "notes.txt").write_text("{not a dump}")
    records, notes = read_dumps([tmp_path])
    assert notes[0] == "read phalanx flight records of rank(s) [0, 1]"
    assert {r.group for r in records[1]} == {"0", "torch pg 0 (default_pg)"}
    assert len(records[1]) == 4


def test_two_dumps_for_one_rank_and_files_that_are_no_dump(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_nccl(tmp_path)
    (tmp_path / "copy_0").write_bytes((tmp_path / "nccl_trace_rank_0").read_bytes())
    assert diagnose.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "two torch Flight Recorder dumps for rank 0" in err and "copy_0" in err
    (tmp_path / "notes.txt").write_text("hello")
    assert diagnose.main([str(tmp_path / "notes.txt")]) == 2
    assert "notes.txt: neither a phalanx dump" in capsys.readouterr().err
    assert diagnose.main([str(tmp_path / "missing")]) == 2


class _Payload:
    """Unpickled by pickle.loads, this would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("protocol", [2, 5])
def test_a_malicious_pickle_dump_is_refused_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], protocol: int
) -> None:
    marker = tmp_path / "pwned"
    doc = _nccl_dump(0)
    doc["entries"][0]["state"] = _Payload(marker)
    evil = tmp_path / "nccl_trace_rank_0"
    evil.write_bytes(pickle.dumps(doc, protocol=protocol))
    assert diagnose.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{evil}: refused to unpickle: opcode" in err and "GLOBAL" in err
    assert not marker.exists()  # nothing from the file ran
    with pytest.raises(UnsafePickleError, match="nccl_trace_rank_0"):
        read_torch_dump(evil)


def test_a_protocol_0_pickle_is_no_torch_dump(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # torch writes protocol 2 (it starts with b"\x80"); an older pickle is not looked into
    marker = tmp_path / "pwned"
    evil = tmp_path / "trace_0"
    evil.write_bytes(pickle.dumps({"entries": [_Payload(marker)]}, protocol=0))
    assert diagnose.main([str(tmp_path)]) == 2  # passed over: no dumps
    assert diagnose.main([str(evil)]) == 2
    assert f"{evil}: neither a phalanx dump" in capsys.readouterr().err
    assert not marker.exists()


def test_a_dump_with_the_wrong_shape_names_file_and_entry(tmp_path: Path) -> None:
    path = tmp_path / "trace_3"
    path.write_text(json.dumps({"version": "2.10", "entries": [{"profiling_name": "gloo:x"}]}))
    with pytest.raises(ValueError, match=r"trace_3: entry 0 is not a Flight Recorder entry"):
        read_torch_dump(path)
    path.write_text(json.dumps({"version": "2.10", "entries": {}}))
    with pytest.raises(ValueError, match=r"trace_3: 'entries' is a dict, not a list"):
        read_torch_dump(path)
    odd = tmp_path / "trace"
    odd.write_bytes(pickle.dumps({"entries": []}, protocol=2))
    with pytest.raises(ValueError, match=r"no rank number at the end of the file name"):
        read_torch_dump(odd)
