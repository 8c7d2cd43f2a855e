"""phalanx benchmarks: phalanx against the torch-native equivalent, interleaved in one run.

Each benchmark module has ``main(argv) -> int``, prints a human table and ends with one line
``RESULT {json}``. ``phalanx bench comm`` runs :mod:`phalanx.bench.comm`. Every suite takes the
flags of :data:`phalanx.bench.common.COMMON_FLAGS` (``--quick``, ``--out``, ``--json``), added by
:func:`phalanx.bench.common.add_common_flags`; :data:`SUITES` says what each one measures.
"""

from __future__ import annotations

__all__ = ["HOSTS_NOTE", "SUITES"]

HOSTS_NOTE = "2 hosts, slow link: root"
"""What the suites that build namespace hosts joined by a capped link (``bench/hosts.py``) need."""

SUITES = {
    "comm": "the backend's collectives against phalanx's ring and tree (--shm: gloo vs shm)",
    "ddp": "phalanx DDP against torch DDP, 2 ranks (--shm: also on shm)",
    "checkpoint": "phalanx checkpoints against torch DCP and a raw write; training beside them",
    "zero": "phalanx ZeRO-1/2/3 against torch's ZeroRedundancyOptimizer and FSDP2, 2 ranks",
    "zero_hybrid": f"hybrid ZeRO-3 against ZeRO-3, DDP and torch HSDP ({HOSTS_NOTE})",
    "pipeline": "GPipe, 1F1B and interleaved schedules against torch.distributed.pipelining",
    "tensor_parallel": "Megatron tensor-parallel layers against torch DTensor, 2 ranks",
    "param_server": "synchronous, asynchronous and bounded-staleness training with a straggler",
    "low_bandwidth": f"DDP against local SGD and DiLoCo ({HOSTS_NOTE})",
    "hosts_backend": f"the hierarchical shm group against gloo ({HOSTS_NOTE})",
    "timeline": "the timeline's recording overhead (A/B), critical-path hit rate, clock error",
    "activations": "activation checkpointing's peak memory and step time, ZeRO-3 and pp=2",
}
"""Every suite of ``phalanx bench SUITE``, with what it measures in one line."""
