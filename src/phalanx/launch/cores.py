"""``phalanx run --bind-cores``: each CPU worker of a node pinned to cores of its own.

Without binding, the kernel moves a node's workers across all its cores, and their OpenMP
threads contend for the same ones; DeepSpeed measured 1.3x for CPU work from binding cores to
ranks (its PR #7474). The launcher splits the cores it may run on (its own affinity mask, in
order) into ``nproc`` contiguous blocks of equal size, one per local rank, the remainder going
to the first ranks; ``OMP_NUM_THREADS`` becomes the block's size unless the user set it. A
worker pins itself at interpreter start (the worker site hook reads
:data:`BIND_ENV`), before the script imports torch. With fewer cores than workers, workers
share cores round robin, and the launcher says so.

torchrun's ``--numa-binding`` binds GPU workers to the CPUs near their GPU; ``--bind-cores`` is
its CPU counterpart and the two are not given together.
"""

from __future__ import annotations

import os

from phalanx.launch.worker_site.sitecustomize import BIND_ENV

__all__ = ["BIND_ENV", "available_cores", "core_blocks", "describe"]


def core_blocks(available: list[int], nproc: int) -> list[list[int]]:
    """``available`` cores split into ``nproc`` contiguous blocks, one per local rank.

    Raises:
        ValueError: ``nproc`` < 1 or no core available.
    """
    if nproc < 1:
        raise ValueError(f"--bind-cores needs at least one worker per node, got {nproc}")
    cores = sorted(set(available))
    if not cores:
        raise ValueError("--bind-cores: this process may run on no core (empty affinity mask)")
    if len(cores) < nproc:  # share: worker i on core i mod n
        return [[cores[i % len(cores)]] for i in range(nproc)]
    size, extra = divmod(len(cores), nproc)
    blocks, start = [], 0
    for i in range(nproc):
        end = start + size + (1 if i < extra else 0)
        blocks.append(cores[start:end])
        start = end
    return blocks


def describe(blocks: list[list[int]]) -> str:
    """The blocks as the launcher's start-up line gives them: ``local rank 0 on cores 0-1, 1
    on 2-3``."""

    def span(block: list[int]) -> str:
        contiguous = block == list(range(block[0], block[-1] + 1))
        return (
            f"{block[0]}-{block[-1]}"
            if contiguous and len(block) > 1
            else ",".join(map(str, block))
        )

    parts = [f"{i} on {'core' if len(b) == 1 else 'cores'} {span(b)}" for i, b in enumerate(blocks)]
    return "local rank " + ", ".join(parts)


def available_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))
