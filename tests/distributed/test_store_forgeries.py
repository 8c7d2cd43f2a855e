"""Forged values planted in the worker store before phalanx writes: checkpoint sessions and hang
reports go on as if they were not there (the e2e test does the same from another process)."""

from __future__ import annotations

import json
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx import checkpoint
from phalanx.comm.group import signed_store
from phalanx.diagnostics import tracking
from phalanx.testing import run_distributed

ENV = {"PHALANX_JOB_SECRET": "c" * 64, "PHALANX_HANG_TIMEOUT": "1.5"}
TOKEN = "feedfacecafe"
FORGED_FILES = {"evil.safetensors": {"sha256": "0" * 64, "bytes": 1}}


def _forge(key: str, value: object) -> None:
    """Write ``value`` at ``key`` as a stranger would: with a made-up tag, or unsigned."""
    raw = signed_store().store  # type: ignore[union-attr]
    text = json.dumps(value)
    raw.set(key, f"phx1 {'ab' * 32} {text}" if hash(key) % 2 else f"phx1 - {text}")


def _checkpoint_with_forgeries(directory: str) -> list[str]:
    import phalanx.checkpoint.sync as sync

    sync.secrets = types.SimpleNamespace(token_hex=lambda n: TOKEN)  # type: ignore[assignment]
    if dist.get_rank() == 0:  # the stranger knows the session's keys before the ranks write
        base = f"phalanx/checkpoint/{TOKEN}/"
        _forge(base + "written/1", {"ok": True, "files": FORGED_FILES})
        _forge(base + "committed", {"ok": True, "path": "/tmp/evil"})
        _forge(base + "tmpdir", {"ok": True, "value": "/tmp/evil"})
        for r in (0, 1):
            _forge(f"{base}closed/{r}", {"ok": True})
    dist.barrier()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    path = checkpoint.save(directory, 1, model=model)
    manifest = (Path(path) / "manifest.json").read_text()
    sync.secrets.token_hex = lambda n: "0123456789ab"  # type: ignore[attr-defined]
    info = checkpoint.load(directory, model=nn.Linear(3, 2))
    assert info is not None and info.step == 1
    return [str(path), manifest]


def test_forged_session_answers_change_no_checkpoint(tmp_path: Path) -> None:
    results = run_distributed(_checkpoint_with_forgeries, str(tmp_path), timeout=60, env=ENV)
    (path0, manifest), (path1, _) = results
    assert path0 == path1 and Path(path0).parent == tmp_path  # not /tmp/evil
    files = json.loads(manifest)["files"]
    assert "model.json" in files and not any("evil" in name for name in files)


def _hang_with_junk() -> tuple[list[str], bool, str | None]:
    raw = signed_store().store  # type: ignore[union-attr]
    if dist.get_rank() == 0:  # issue 14's two writes, and every key of the hang protocol
        raw.set("phalanx/hang/who", "x")
        raw.add("phalanx/hang/count", 1)
        raw.add("phalanx/hang/bell", 5)
        _forge("phalanx/hang/incident/1", {"n": 1, "opener": 1, "at": 0.0, "stuck": {}})
        _forge("phalanx/hang/answer/1/1", {"at": 0, "in_flight": None, "stack": [], "records": []})
        _forge("phalanx/hang/report/1", {"text": "forged report"})
        raw.set("phalanx/hang/incident/2", b"\xff\xfe")
        _forge("phalanx/mismatch", {"text": "forged mismatch"})
        _forge("phalanx/who/1", {"host": "evil", "pid": 1, "dir": "/", "main": 1})
        _forge("phalanx/progress/1", {"0": [10**9, "all_reduce"]})
    t = torch.ones(3)
    phalanx.all_reduce(t)
    time.sleep(1.0)  # several ticks of the progress thread over the junk
    if dist.get_rank() == 1:
        time.sleep(5.0)
    phalanx.all_reduce(t)
    assert tracking._T is not None and tracking._T.thread is not None
    return tracking.hang_reports(), tracking._T.thread.is_alive(), tracking.mismatch_found()


def test_junk_hang_keys_do_not_switch_off_hang_reports() -> None:
    results = run_distributed(_hang_with_junk, world_size=2, timeout=60, env=ENV)
    for reports, alive, mismatch in results:
        assert alive and mismatch is None  # the forged finding is not believed
        assert len(reports) == 1  # the real hang, once; no report for the forged incident
        assert "rank 0 has waited" in reports[0] and "Rank(s) [1] never reached it." in reports[0]
        assert "forged" not in reports[0]
