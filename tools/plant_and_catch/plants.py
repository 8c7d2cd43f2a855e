"""Seven bugs of the kinds that make one run quietly differ from another, planted into phalanx.

``install(name)`` patches phalanx in this process; ``train.py`` calls it with ``PHALANX_PLANT``.
Each plant is one small change to the real code path, as a bug in phalanx (or in a script
written against it) would make:

- ``sampler_repeat``: a resumed sampler starts one sample early, so a sample seen before the
  save is seen again;
- ``rng_not_restored``: a resume leaves the generators as the new process made them (dropout
  masks differ from the uninterrupted run's);
- ``grad_scale_world4``: at 4 ranks each rank's loss is scaled as if the gradients were
  averaged over 3 (the sum divided by the wrong count);
- ``missed_no_sync``: the micro-steps of an accumulation window sync (``no_sync`` is missed),
  and ZeRO-2's reduced gradient of each sync replaces the previous one instead of adding to it:
  what a reducer that counts on ``no_sync`` windows loses;
- ``buffer_not_broadcast``: DDP's start-up broadcast sends the parameters but not the buffers
  (the ranks built their buffers from different seeds);
- ``zero_shard_order``: the job's checkpoints hold each ZeRO optimizer-state piece in reverse
  element order (read back in the right order, so a resume starts from scrambled state);
- ``scheduler_twice``: a resume steps the LR scheduler once more after loading it.
"""

from __future__ import annotations

from typing import Any

import torch

ENV = "PHALANX_PLANT"

PLANTS = (
    "sampler_repeat",
    "rng_not_restored",
    "grad_scale_world4",
    "missed_no_sync",
    "buffer_not_broadcast",
    "zero_shard_order",
    "scheduler_twice",
)


def _sampler_repeat() -> None:
    from phalanx.data.sampler import DistributedSampler

    load = DistributedSampler.load_state_dict

    def planted(self: DistributedSampler, state: dict[str, Any]) -> None:
        state = dict(state)
        if state.get("position", 0) > 0:
            state["position"] -= 1
        load(self, state)

    DistributedSampler.load_state_dict = planted  # type: ignore[method-assign]


def _rng_not_restored() -> None:
    from phalanx.checkpoint import loading

    loading.restore_rng = lambda doc, where: []  # type: ignore[assignment]


def _grad_scale_world4() -> None:
    from phalanx.train.strategies.base import Runner

    backward = Runner.backward

    def planted(self: Runner, loss: torch.Tensor, precision: Any, grad_accum: int) -> None:
        if self.world.world_size == 4:
            loss = loss * 4 / 3
        backward(self, loss, precision, grad_accum)

    Runner.backward = planted  # type: ignore[method-assign]


def _missed_no_sync() -> None:
    from phalanx.sharding import grad_reduce_scatter as grs
    from phalanx.train.strategies.base import Runner

    def always_sync(self: Runner, sync: bool) -> None:
        original(self, True)

    original = Runner.require_backward_grad_sync
    Runner.require_backward_grad_sync = always_sync  # type: ignore[method-assign]
    complete = grs.GradReducer.complete

    def replacing(self: Any, b: int, flight: Any) -> None:
        self._grads[b] = None  # the previous sync's reduced gradient is dropped
        complete(self, b, flight)

    grs.GradReducer.complete = replacing  # type: ignore[method-assign]


def _buffer_not_broadcast() -> None:
    from phalanx.data_parallel.ddp import DistributedDataParallel

    broadcast = DistributedDataParallel._broadcast_state

    def planted(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["with_buffers"] = False
        broadcast(self, *args, **kwargs)

    DistributedDataParallel._broadcast_state = planted  # type: ignore[method-assign]
    DistributedDataParallel.will_sync_module_buffers = lambda self: False  # type: ignore[method-assign]


def _zero_shard_order() -> None:
    from phalanx.sharding import zero_pieces
    from phalanx.train.job_checkpoint import Checkpoints

    sharded, save = zero_pieces.sharded_state, Checkpoints.save
    saving = [False]  # the job's own checkpoints only (not phalanx verify's snapshots)

    def planted(opt: Any, writes: bool = True) -> Any:
        state = sharded(opt, writes)
        if saving[0]:
            state.pieces[:] = [(p, t.flip(0)) for p, t in state.pieces]
        return state

    def job_save(self: Checkpoints, *args: Any, **kwargs: Any) -> Any:
        saving[0] = True
        try:
            return save(self, *args, **kwargs)
        finally:
            saving[0] = False

    zero_pieces.sharded_state = planted  # type: ignore[assignment]
    Checkpoints.save = job_save  # type: ignore[method-assign]


def _scheduler_twice() -> None:
    from phalanx.train.job_checkpoint import Checkpoints

    load = Checkpoints.load_newest

    def planted(self: Checkpoints) -> int:
        epoch = load(self)
        if self.state.step and self.state.scheduler is not None:  # a checkpoint was loaded
            self.state.scheduler.step()
        return epoch

    Checkpoints.load_newest = planted  # type: ignore[method-assign]


def install(name: str) -> None:
    """Plant ``name`` (one of :data:`PLANTS`; "" plants nothing)."""
    if not name:
        return
    if name not in PLANTS:
        raise ValueError(f"{ENV}={name!r} is not one of {', '.join(PLANTS)}")
    globals()[f"_{name}"]()
