"""``phalanx.LocalSGD``, ``phalanx.DiLoCo`` and ``phalanx.StreamingDiLoCo`` in a Job on 2 gloo
ranks (one set of rank processes for every run; ``local_sgd_cases.py`` trains and simulates).

- Against a one-process simulation of both replicas (each its own optimizer on its own
  batches; every H steps the average, or DiLoCo's outer step with torch's SGD): bitwise equal,
  since the 2-rank average is ``(a + b) / 2`` in either order and every other operation is the
  same on the same inputs.
- The base cases: H = 1 LocalSGD and DiLoCo (outer lr 1, no momentum) against DDP, with
  plain SGD (see ``test_h1_equals_ddp`` for the tolerance).
- Streaming DiLoCo: one fragment, offset 0, no overlap is DiLoCo, bitwise (fp32 and int8
  outer gradients); two fragments on staggered beats with a 1-step overlap and int8 / int4
  outer gradients equal the simulation of the paper's schedule, bitwise.
- ``flush()`` at the end leaves every replica with the same model.
- Bytes: what each rank hands to collectives is its parameters once per synchronisation
  (encoded: values and scales, when quantised), counted alike by ``SyncStats`` and
  ``phalanx.comm_stats()``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.local_sgd.quantise import encoded_bytes
from phalanx.testing import run_distributed
from tests.distributed.local_sgd_cases import (
    BLOCK,
    OUTER,
    STEPS,
    adamw,
    sgd,
    simulate,
    simulate_streaming,
    train,
)


def _streaming(codec: str) -> phalanx.StreamingDiLoCo:
    opts = {"fragments": 2, "offsets": (0, 1), "overlap": 1, "quantise_block": BLOCK}
    return phalanx.StreamingDiLoCo(sync_every=3, quantise=codec, **opts, **OUTER)


def _every_run() -> dict[str, Any]:
    out: dict[str, Any] = {
        "localsgd": train(phalanx.LocalSGD(sync_every=3), adamw),
        "diloco": train(phalanx.DiLoCo(sync_every=3, **OUTER), adamw),
        "h1-ddp": train("ddp", sgd),
        "h1-localsgd": train(phalanx.LocalSGD(sync_every=1), sgd),
        "h1-diloco": train(phalanx.DiLoCo(sync_every=1, outer_lr=1.0, outer_momentum=0.0), sgd),
    }
    q = {"quantise": "int8", "quantise_block": BLOCK}
    out["diloco-int8"] = train(phalanx.DiLoCo(sync_every=3, **q, **OUTER), adamw)
    one = {"fragments": 1, "offsets": (0,), "overlap": 0}
    for codec, quantise in (("fp32", {}), ("int8", q)):
        streaming = phalanx.StreamingDiLoCo(sync_every=3, **one, **quantise, **OUTER)
        out[f"streaming1-{codec}"] = train(streaming, adamw)
    for codec in ("int8", "int4"):
        out[f"streaming2-{codec}"] = train(_streaming(codec), adamw)
    out["localsgd-flushed"] = train(phalanx.LocalSGD(sync_every=3), adamw, flush=True)
    out["diloco-flushed"] = train(phalanx.DiLoCo(sync_every=3, **OUTER), adamw, flush=True)
    out["streaming2-int8-flushed"] = train(_streaming("int8"), adamw, flush=True)
    if dist.get_rank() == 0:
        out["sim-localsgd"] = simulate(3, adamw, None)
        out["sim-diloco"] = simulate(3, adamw, {"lr": 0.7, "momentum": 0.9})
        for codec in ("int8", "int4"):
            out[f"sim-streaming2-{codec}"] = simulate_streaming(3, 2, [0, 1], 1, codec)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_every_run, world_size=2, timeout=120)


def _numel(runs: list[dict[str, Any]]) -> int:
    return sum(p.numel() for p in runs[0]["diloco"]["params"])


@pytest.mark.parametrize("name", ["localsgd", "diloco", "streaming2-int8", "streaming2-int4"])
def test_equal_to_a_one_process_simulation_bitwise(name: str, runs: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(runs):
        # Each rank's replica after STEPS = 7 steps, H = 3.
        for i, (a, b) in enumerate(zip(got[name]["params"], runs[0][f"sim-{name}"][rank])):
            assert torch.equal(a, b), f"{name} rank {rank} parameter {i}"
    # After the last sync each rank took steps of its own: the replicas differ (streaming:
    # in the fragment whose average is still in flight).
    assert not torch.equal(runs[0][name]["params"][-1], runs[1][name]["params"][-1])


def test_bytes_sent_are_the_parameters_once_per_sync(runs: list[dict[str, Any]]) -> None:
    numel = _numel(runs)
    for name in ("localsgd", "diloco"):
        # Two synchronisations (after steps 3 and 6), each the parameters once, in float32.
        assert runs[0][name]["stats"] == (2, 2 * 4 * numel)
        assert runs[0][name]["sent"] == 2 * 4 * numel, "comm_stats counts the same bytes"
    int8 = 2 * encoded_bytes(numel, "int8", BLOCK)
    assert runs[0]["diloco-int8"]["stats"] == (2, int8)
    assert runs[0]["diloco-int8"]["sent"] == int8, "comm_stats counts the encoded bytes"
    assert int8 < 0.35 * 2 * 4 * numel
    # Two fragments, offsets 0 and 1 of H = 3: launches after steps 1, 3, 4, 6 and 7.
    assert runs[0]["streaming2-int8"]["stats"][0] == 5


def test_h1_equals_ddp(runs: list[dict[str, Any]]) -> None:
    """H = 1 with plain SGD is DDP's step, in a different order of float operations.

    DDP steps p − lr·(g₀ + g₁)/2; LocalSGD averages ((p − lr·g₀) + (p − lr·g₁))/2; DiLoCo
    steps p − 1·((p − p₀) + (p − p₁))/2. Each rounds differently, by an ulp or so of the
    parameters per step (|p| < 0.5 here: ulp <= 2⁻²⁵ ≈ 3e-8). The tolerance, atol 1e-6 (about
    33 such ulps over 7 steps), leaves room for that and nothing more: a wrong average or a
    missed step moves them by ~lr·|g| ≈ 1e-2. Measured: 1.2e-7 for both (4 ulps). Replicas
    are bitwise equal to each other.
    """
    for rank, got in enumerate(runs):
        ref = got["h1-ddp"]["params"]
        for name in ("h1-localsgd", "h1-diloco"):
            for i, (a, b) in enumerate(zip(got[name]["params"], ref)):
                diff = (a - b).abs().max().item()
                assert diff <= 1e-6, f"rank {rank} {name} parameter {i}: max |diff| {diff}"
                assert torch.equal(a, runs[0][name]["params"][i]), "replicas differ"
    numel = _numel(runs)
    # Every step synchronises the parameters once: what DDP sends in gradients.
    assert runs[0]["h1-localsgd"]["stats"] == (STEPS, STEPS * 4 * numel)
    assert runs[0]["h1-ddp"]["sent"] == STEPS * 4 * numel


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_one_fragment_without_overlap_is_diloco(codec: str, runs: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(runs):
        one, ref = got[f"streaming1-{codec}"], got["diloco" if codec == "fp32" else "diloco-int8"]
        assert all(map(torch.equal, one["params"], ref["params"])), f"rank {rank} {codec}"
        assert one["stats"] == ref["stats"]


def test_flush_leaves_every_replica_with_one_model(runs: list[dict[str, Any]]) -> None:
    for name in ("localsgd-flushed", "diloco-flushed", "streaming2-int8-flushed"):
        for a, b in zip(runs[0][name]["params"], runs[1][name]["params"]):
            assert torch.equal(a, b), name
    # The flush is the average of where the replicas were (the runs are the same); DiLoCo's
    # takes no outer step (final_sync).
    for name in ("localsgd", "diloco"):
        ends = [r[name]["params"] for r in runs]
        for a, b0, b1 in zip(runs[0][f"{name}-flushed"]["params"], *ends):
            assert torch.equal(a, (b0 + b1) / 2), name
    assert runs[0]["localsgd-flushed"]["stats"][0] == 3  # steps 3, 6, and the flush
    # Streaming: the 5 launches, then one outer step of the whole model.
    assert runs[0]["streaming2-int8-flushed"]["stats"][0] == 6
