"""``phalanx bench checkpoint``: save/load throughput of phalanx vs torch.distributed.checkpoint.

One process, one model state (``--mb`` MB of float32 parameters in a stack of linear layers).
Each round saves, then loads, the same state with each implementation, in rotating order
(ABC, BCA, CAB, ...):

- ``phalanx``: :func:`phalanx.checkpoint.save` / :func:`~phalanx.checkpoint.load` (safetensors,
  crc32c of every file, fsync, atomic commit; load maps, verifies and copies into the model);
- ``dcp``: ``torch.distributed.checkpoint.save`` / ``load`` of the model's state dict;
- ``raw``: the same bytes with ``open().write()`` + fsync into one file, and ``readinto``
  straight back into the tensors (no hashing, no format): the floor.

Throughput is state bytes / median time. Loads read files that were just written (page cache
warm) unless ``--cold``, which evicts every file with ``posix_fadvise(DONTNEED)`` first. Each
round's times are printed as measured (and kept in ``--out``); last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.bench.common import Output, add_output_flags

__all__ = ["main"]

IMPLS = ("phalanx", "dcp", "raw")


def make_model(mb: float) -> nn.Module:
    """Linear 1024x1024 layers (4 MiB of weights each) adding up to about ``mb`` MB."""
    layers = max(1, round(mb * 1e6 / (1024 * 1025 * 4)))
    return nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(layers)))


def _state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _raw_save(model: nn.Module, path: Path) -> None:
    path.mkdir()
    with open(path / "raw.bin", "wb", buffering=0) as f:
        for t in model.state_dict().values():
            f.write(t.detach().reshape(-1).view(torch.uint8).numpy())
        os.fsync(f.fileno())


def _raw_load(model: nn.Module, path: Path) -> None:
    with open(path / "raw.bin", "rb", buffering=0) as f:
        for t in model.state_dict().values():
            f.readinto(t.detach().reshape(-1).view(torch.uint8).numpy())


def _dcp_save(model: nn.Module, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    dcp.save(model.state_dict(), checkpoint_id=str(path))


def _dcp_load(model: nn.Module, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(path))  # in place, into the model's tensors


def _phalanx_save(model: nn.Module, path: Path) -> None:
    from phalanx import checkpoint

    checkpoint.save(path, 1, model=model, keep_last=1)


def _phalanx_load(model: nn.Module, path: Path) -> None:
    from phalanx import checkpoint

    checkpoint.load(path, model=model)


OPS: dict[str, tuple[Callable[[nn.Module, Path], None], Callable[[nn.Module, Path], None]]] = {
    "phalanx": (_phalanx_save, _phalanx_load),
    "dcp": (_dcp_save, _dcp_load),
    "raw": (_raw_save, _raw_load),
}


def _evict(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(
    mb: float, rounds: int, cold: bool, workdir: Path, output: Output | None = None
) -> dict[str, dict[str, list[float]]]:
    """Save and load times (s) per implementation, interleaved over ``rounds`` rounds."""
    torch.manual_seed(0)
    model = make_model(mb)
    times: dict[str, dict[str, list[float]]] = {i: {"save": [], "load": []} for i in IMPLS}
    for r in range(rounds + 1):  # round 0 warms up (imports, page allocation)
        order = IMPLS[r % 3 :] + IMPLS[: r % 3]
        for impl in order:
            save, load = OPS[impl]
            path = workdir / f"{impl}-{r}"
            t_save = _timed(lambda: save(model, path))  # noqa: B023
            if cold:
                _evict(path)
            t_load = _timed(lambda: load(model, path))  # noqa: B023
            shutil.rmtree(path)
            if r:
                times[impl]["save"].append(t_save)
                times[impl]["load"].append(t_load)
                if output is not None:
                    output.rows([{"round": r, "impl": impl, "save_s": t_save, "load_s": t_load}])
    return times


def summarize(times: dict[str, dict[str, list[float]]], nbytes: int) -> dict[str, Any]:
    """Median seconds, MB/s, and ratios phalanx/dcp and phalanx/raw (of throughput)."""
    out: dict[str, Any] = {"state_mb": nbytes / 1e6, "impls": {}}
    for impl, by_op in times.items():
        row: dict[str, float] = {}
        for op, ts in by_op.items():
            row[f"{op}_s"] = statistics.median(ts)
            row[f"{op}_mbps"] = nbytes / 1e6 / row[f"{op}_s"]
        out["impls"][impl] = row
    ours = out["impls"]["phalanx"]
    for other in ("dcp", "raw"):
        for op in ("save", "load"):
            out[f"{op}_ratio_vs_{other}"] = ours[f"{op}_mbps"] / out["impls"][other][f"{op}_mbps"]
    return out


def _print(result: dict[str, Any], rounds: int, cold: bool) -> None:
    cache = "cold (evicted)" if cold else "warm"
    print(f"checkpoint of {result['state_mb']:.1f} MB, {rounds} rounds, median; page cache {cache}")
    print(f"{'impl':<9}{'save s':>9}{'save MB/s':>11}{'load s':>9}{'load MB/s':>11}")
    for impl, r in result["impls"].items():
        print(
            f"{impl:<9}{r['save_s']:>9.3f}{r['save_mbps']:>11.0f}{r['load_s']:>9.3f}"
            f"{r['load_mbps']:>11.0f}"
        )
    for other in ("dcp", "raw"):
        print(
            f"phalanx / {other} throughput: save {result[f'save_ratio_vs_{other}']:.2f}x, "
            f"load {result[f'load_ratio_vs_{other}']:.2f}x"
        )


def main(argv: list[str] | None = None) -> int:
    """``phalanx bench checkpoint [--mb 150] [--rounds 5] [--cold] [--dir D] [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="phalanx bench checkpoint", description=__doc__)
    parser.add_argument("--mb", type=float, default=150.0, help="model state size in MB")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--cold", action="store_true", help="evict files before loading")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    add_output_flags(parser, "checkpoint")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.mb <= 0:
        parser.error(f"--rounds must be >= 1 and --mb > 0, got {args.rounds} and {args.mb}")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    output = Output.create("checkpoint", args.out, args.json)
    workdir = Path(tempfile.mkdtemp(prefix="phalanx-bench-ckpt-", dir=args.dir))
    try:
        times = measure(args.mb, args.rounds, args.cold, workdir, output)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = summarize(times, _state_bytes(make_model(args.mb)))
    result.update(rounds=args.rounds, cold=args.cold)
    _print(result, args.rounds, args.cold)
    output.result(result)
    return 0
