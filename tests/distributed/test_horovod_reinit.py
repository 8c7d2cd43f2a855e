"""hvd.shutdown() then hvd.init(), again and again, on 2 ranks that share one rendezvous store
(as under ``phalanx run``, whose launcher hosts it): every generation must find its own keys,
not the previous group's (without the generation namespace about one re-init in four failed)."""

from __future__ import annotations

from datetime import timedelta

import torch

import phalanx
import phalanx.horovod as hvd
from phalanx.comm.store import host_store
from phalanx.testing import run_distributed

CYCLES = 12


def _cycles() -> list[float]:
    # Leave the harness's group (hvd.init() makes its own), once every rank's connections are
    # up: gloo's init returns on one rank while the other may still be connecting.
    torch.distributed.barrier()
    phalanx.destroy_process_group()
    sums = []
    for k in range(CYCLES):
        hvd.init()
        assert hvd.is_initialized() and hvd.size() == 2
        sums.append(float(hvd.allreduce(torch.full((1,), float(k)), op=hvd.Sum)))
        hvd.barrier()
        hvd.shutdown()
        assert not hvd.is_initialized()
    return sums


def test_shutdown_then_init_works_every_time() -> None:
    store, port = host_store("127.0.0.1", 0, timedelta(seconds=30))
    # The ranks connect to this store as clients, as they do to phalanx run's launcher.
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "15",
    }
    try:
        results = run_distributed(_cycles, world_size=2, timeout=90, env=env)
    finally:
        del store
    assert results == [[2.0 * k for k in range(CYCLES)]] * 2
