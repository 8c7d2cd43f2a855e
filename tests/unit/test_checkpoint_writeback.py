"""A checkpoint file's pages are queued to disk every few MiB while it is written."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint import atomic, writeback
from phalanx.checkpoint.checksum import TensorBytes

MIB = 1024 * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_linux_has_the_call() -> None:
    assert writeback._SYNC_FILE_RANGE is not None


def test_every_few_mib_written_are_queued_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int, int, int]] = []

    def record(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append((fd, offset, nbytes, flags))
        return 0

    monkeypatch.setattr(writeback, "_SYNC_FILE_RANGE", record)
    tensor = torch.arange(5 * MIB, dtype=torch.float32)  # 20 MiB, written in 8 MiB chunks
    data = memoryview(tensor.numpy()).cast("B")
    entry = atomic.write_file(tmp_path / "t.safetensors", [b"head", TensorBytes("t", data)])

    assert entry.bytes == 4 + 20 * MIB
    assert (tmp_path / "t.safetensors").read_bytes()[4:] == bytes(data)
    assert [c[3] for c in calls] == [2] * len(calls)  # SYNC_FILE_RANGE_WRITE: start, no wait
    # contiguous ranges from the file's start, each of at least 4 MiB, the tail left to fsync
    starts = [c[1] for c in calls]
    assert starts[0] == 0
    assert all(c[2] >= writeback._EVERY for c in calls)
    assert all(a[1] + a[2] == b[1] for a, b in itertools.pairwise(calls))
    assert calls[-1][1] + calls[-1][2] <= entry.bytes


def test_a_small_file_is_left_to_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(writeback, "_SYNC_FILE_RANGE", lambda *args: calls.append(1) or 0)
    atomic.write_file(tmp_path / "small.json", [b"{}" * 1000])
    assert calls == []


def test_without_the_call_files_are_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writeback, "_SYNC_FILE_RANGE", None)
    payload = bytes(range(256)) * (40 * 1024)  # 10 MiB
    atomic.write_file(tmp_path / "x.bin", [payload])
    assert (tmp_path / "x.bin").read_bytes() == payload


def test_an_asynchronous_save_queues_nothing_early_and_writes_at_a_lower_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside training, the kernel's early I/O work would take the training's core: the
    background write thread leaves its pages to the fsync, and yields the CPU to training
    (nice 10)."""
    import os
    import threading

    from phalanx.checkpoint import background

    calls: list[int] = []
    monkeypatch.setattr(writeback, "_SYNC_FILE_RANGE", lambda *args: calls.append(1) or 0)
    payload = bytes(range(256)) * (40 * 1024)  # 10 MiB: queued early on any other thread
    seen: dict[str, object] = {}

    def write() -> Path:
        seen["thread"] = threading.current_thread().name
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        atomic.write_file(tmp_path / "bg.bin", [payload])
        return tmp_path

    background.start("a test write", write)
    assert background.wait() == tmp_path
    assert seen["thread"] == background.THREAD_NAME and calls == []
    if sys.platform.startswith("linux"):
        assert seen["nice"] == background.NICE
    atomic.write_file(tmp_path / "fg.bin", [payload])
    assert calls  # the same write on this thread queued its pages early
    assert (tmp_path / "bg.bin").read_bytes() == (tmp_path / "fg.bin").read_bytes() == payload
