"""Save step 1, then die by SIGKILL inside the save of step 2 at a fault point.

``python checkpoint_crash.py DIR POINT``: prints one JSON line with the sha256 of every file of
the committed step-1 checkpoint, then sets ``PHALANX_CHECKPOINT_FAULT=POINT`` and saves step 2,
which kills the process (exit code -9). Exit code 3 means the fault never fired.
``POINT`` ``between-renames`` saves step 1 again instead (with ``keep_last=1``, so step 1 has one
copy), dying after its old directory is renamed aside and before the new one takes its name.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
from torch import nn

from phalanx import checkpoint
from phalanx.checkpoint.atomic import FAULT_ENV


def model_and_optimizer() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """About 2 MB of parameters (and 4 MB of AdamW state), deterministic."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(16, 256)).pow(2).mean().backward()
    opt.step()


def main(directory: str, point: str) -> int:
    torch.set_num_threads(1)
    model, opt = model_and_optimizer()
    _step(model, opt)
    resave = point == "between-renames"
    keep = 1 if resave else 3
    path = checkpoint.save(
        directory, 1, model=model, optimizer=opt, extra={"tag": "one"}, keep_last=keep
    )
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}
    print(json.dumps(digests), flush=True)
    _step(model, opt)
    os.environ[FAULT_ENV] = point
    step, tag = (1, "one again") if resave else (2, "two")
    checkpoint.save(directory, step, model=model, optimizer=opt, extra={"tag": tag}, keep_last=keep)
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
