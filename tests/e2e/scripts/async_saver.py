"""Saves asynchronously in a loop, changing its state in place while each write runs.

    python async_saver.py DIR LOG [--mb 24] [--saves 1000] [--fault POINT]

Before each ``save(async_=True)`` it appends ``saved STEP DIGEST`` to LOG (a digest of the
model and optimizer tensors it is about to save), and ``committed STEP`` once ``wait()``
returned, so after a SIGKILL at any moment LOG tells what each checkpoint must hold. With
``--fault`` it sets ``PHALANX_CHECKPOINT_FAULT`` after the first commit, so the second save's
background write kills the process at that point. Used by ``tools/checkpoint_async_soak.py``
and ``tests/e2e/test_checkpoint_crash.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import crc32c
import torch
from torch import nn

from phalanx import checkpoint
from phalanx.checkpoint.atomic import FAULT_ENV


def build(mb: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model whose parameters plus AdamW state take about ``mb`` MB, one step trained."""
    width = max(8, int((mb * 1e6 / 4 / 3 / 4) ** 0.5))  # 4 square layers, 3 copies (Adam)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 over every model and optimizer-state tensor's name, dtype, shape and crc32c
    (crc32c keeps up with memory: a slow digest would leave few kills inside a write)."""
    h = hashlib.sha256()
    tensors = dict(model.state_dict())
    for index, state in opt.state_dict()["state"].items():
        tensors.update({f"opt.{index}.{k}": v for k, v in state.items()})
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        crc = crc32c.crc32c(t.view(-1).view(torch.uint8).numpy())
        h.update(f"{name} {t.dtype} {tuple(t.shape)} {crc:08x};".encode())
    return h.hexdigest()


def _train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """Change every saved tensor in place, as training does."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(step * 1e-3)
        for state in opt.state.values():
            state["exp_avg"].mul_(0.9)
            state["exp_avg_sq"].add_(1e-4)


def _log(log: Path, line: str) -> None:
    with open(log, "a") as f:  # in the page cache once written: a SIGKILL cannot lose it
        f.write(line + "\n")


def verify(directory: Path, log: Path, mb: float) -> dict[str, object]:
    """Load the newest committed checkpoint of ``directory``; compare it with what LOG recorded.

    Returns ``loaded`` (its step, None when there is none), ``committed`` (the last step LOG
    saw committed), ``equal`` (its tensors' digest is the one recorded when it was saved) and
    ``in_write`` (a temporary directory was left: the kill landed inside a write).
    """
    saved: dict[int, str] = {}
    committed = 0
    for line in log.read_text().splitlines():
        kind, step, *rest = line.split()
        if kind == "saved" and rest:
            saved[int(step)] = rest[0]
        elif kind == "committed":
            committed = int(step)
    in_write = any(p.name.startswith(".tmp-step-") for p in directory.iterdir())
    model, opt = build(mb)
    info = checkpoint.load(directory, model=model, optimizer=opt)
    loaded = None if info is None else info.step
    equal = loaded is not None and saved.get(loaded) == digest(model, opt)
    return {"loaded": loaded, "committed": committed, "equal": equal, "in_write": in_write}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("log", type=Path)
    parser.add_argument("--mb", type=float, default=24.0)
    parser.add_argument("--saves", type=int, default=1000)
    parser.add_argument("--fault", default=None)
    args = parser.parse_args()
    model, opt = build(args.mb)
    for step in range(1, args.saves + 1):
        _train(model, opt, step)
        _log(args.log, f"saved {step} {digest(model, opt)}")
        checkpoint.save(args.directory, step, model=model, optimizer=opt, keep_last=2, async_=True)
        _train(model, opt, step)  # while the write runs: not in the checkpoint
        checkpoint.wait()
        _log(args.log, f"committed {step}")
        if args.fault is not None:
            os.environ[FAULT_ENV] = args.fault


if __name__ == "__main__":
    main()
