"""What a live e2e script reports: one JSON-able record per member, published whole (imported
by the scripts beside this file, which run with this folder on ``sys.path``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

import phalanx


def live_record(job: phalanx.Job, params: torch.Tensor, started_pid: int) -> dict[str, Any]:
    """The member's pids, step, membership changes, ledger problems and final parameters."""
    assert job.live is not None and job.live.ledger is not None
    return {
        "pid": os.getpid(),
        "started_pid": started_pid,
        "step": job.step_count,
        "world_size": job.world.world_size,
        "regroups": [[r.kind, r.world_size, r.step] for r in job.live.regroups],
        "regroup_seconds": [r.seconds for r in job.live.regroups],
        "problems": job.live.ledger.problems(),
        "ledger_epochs": job.live.ledger.epochs,
        "digest": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "params": params.tolist(),
    }


def publish(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` as JSON so that a reader never sees it half written (the tests poll for
    these files and read them at once: a plain write was once read empty beside a busy CI)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)
