"""What every benchmark shares: a collective-aware timer and the ``RESULT {json}`` ending."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

__all__ = ["emit", "timed"]


def timed(fn: Callable[[], None]) -> float:
    """Seconds ``fn`` took on the slowest rank, started together after a barrier."""
    import torch

    import phalanx

    phalanx.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start])
    phalanx.all_reduce(took, phalanx.ReduceOp.MAX)
    return float(took)


def emit(payload: dict[str, Any], json_path: str | None) -> None:
    """Write ``payload`` to ``json_path`` (if given) and print the final ``RESULT`` line."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=1)
    print("RESULT " + json.dumps(payload), flush=True)
