"""What mirroring ZeRO shards on a neighbour costs: time per training step and memory held.

    python tools/peer_shards_cost.py [--worlds 2 4] [--steps 16]

A ZeRO-2 Adam job on gloo ranks (``phalanx.testing.run_distributed``) trains an MLP of 6.3 M
fp32 parameters (25.2 MB: six 1024 x 1024 layers) on a batch of 8. Per world size, in one run:
``--steps`` steps without a mirror, then with a :class:`~phalanx.recovery.ShardMirror` at
``every=1``, then at ``every=4``. Reported per setting, on the slowest rank:

- ``refresh_ms_per_step``: training-thread time in ``after_step`` per step (the memcpy of this
  rank's pieces, plus any wait for the previous exchange), averaged over all steps; the join of
  the last exchange when the measurement stops is ``final_wait_ms``, not in it;
- ``copy_ms_per_refresh`` and ``exchange_ms_per_refresh`` (background thread: send own
  buffer to the left neighbour, receive the right one's), wall time, and the same in CPU time
  of the thread doing it (``*_cpu_ms_*``: what a shared machine's load does not inflate);
- ``step_ms``: median wall time of a whole step (forward, backward, step, refresh) next to the
  same without a mirror (on a shared machine the step times are noisy; the refresh times are
  measured directly);
- ``snapshot_mb`` (one rank's pieces) and ``held_mb`` (own + mirrored snapshots kept).

Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MB = 1e6


def _worker(steps: int) -> dict[str, Any]:
    from phalanx.recovery import ShardMirror
    from phalanx.sharding import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=2, lr=1e-4)
    x, y = torch.randn(8, 1024), torch.randn(8, 1024)
    done = 0

    def train(mirror: Any) -> tuple[list[float], float, float]:
        nonlocal done
        times, refresh, last = [], 0.0, 0.0
        for _ in range(steps):
            start = time.perf_counter()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            done += 1
            if mirror is not None:
                t = time.perf_counter()
                mirror.after_step(done)
                refresh += time.perf_counter() - t
            times.append(time.perf_counter() - start)
        if mirror is not None:  # the last exchange, joined when the measurement stops
            t = time.perf_counter()
            mirror.wait()
            last = time.perf_counter() - t
        return times, refresh, last

    train(None)  # warm-up: Adam's state exists from here on
    base, _, _ = train(None)
    out: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}
    out["none"] = {"step_ms": 1e3 * statistics.median(base)}
    for every in (1, 4):
        mirror = ShardMirror(opt, every=every)
        times, refresh, last = train(mirror)
        s = mirror.stats
        out[f"every={every}"] = {
            "step_ms": 1e3 * statistics.median(times),
            "refresh_ms_per_step": 1e3 * refresh / steps,
            "final_wait_ms": 1e3 * last,
            "refreshes": s.refreshes,
            "copy_ms_per_refresh": 1e3 * s.copy_s / max(s.refreshes, 1),
            "copy_cpu_ms_per_refresh": 1e3 * s.copy_cpu_s / max(s.refreshes, 1),
            "exchange_ms_per_refresh": 1e3 * s.exchange_s / max(s.refreshes, 1),
            "exchange_cpu_ms_per_refresh": 1e3 * s.exchange_cpu_s / max(s.refreshes, 1),
            "snapshot_mb": mirror.own[-1].nbytes / MB,
            "held_mb": mirror.held_bytes() / MB,
        }
        del mirror
    dist.barrier()
    return out


def _slowest(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting, each number's maximum over the ranks."""
    out: dict[str, Any] = {"params": ranks[0]["params"]}
    for key in ranks[0]:
        if key != "params":
            out[key] = {k: round(max(r[key][k] for r in ranks), 2) for k in ranks[0][key]}
    return out


def main() -> None:
    from phalanx.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    result: dict[str, Any] = {"model_mb": None, "steps": args.steps, "worlds": {}}
    for world in args.worlds:
        ranks = run_distributed(_worker, args.steps, world_size=world, timeout=600)
        summary = _slowest(ranks)
        result["model_mb"] = round(summary.pop("params") * 4 / MB, 1)
        result["worlds"][str(world)] = summary
        print(f"world {world}: {json.dumps(summary)}", flush=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
