"""What a :class:`phalanx.Job` trains and where it is: the one record its parts share.

``Job.step()``, ``Job.epochs()``, the job's loaders (:mod:`.resume_point`), checkpoints
(:mod:`.job_checkpoint`) and the live exchange (:mod:`.live_state`) all take this record as an
argument instead of the job: the counters (step, epoch, the open accumulation window) and the
objects whose state is saved beside the model and optimizer (scheduler, sampler, tracked
objects, the fp16 loss scale). The model and optimizer themselves belong to the strategy's
runner (``runner.checkpointed()``), which shards them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only
    from torch.optim.lr_scheduler import LRScheduler

    from phalanx.data.elastic_sampler import ElasticSampler
    from phalanx.data.sampler import DistributedSampler
    from phalanx.train.grad_scaler import AgreedGradScaler
    from phalanx.train.precision import Precision

__all__ = ["Stateful", "TrainState"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()``: torch's checkpointing protocol
    (``torch.distributed.checkpoint.stateful.Stateful``), declared here because importing
    torch's pulls in DTensor (about 0.9 s of CPU in every process that makes a ``Job``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """The job's training state (``job.state``).

    Args:
        precision: The job's precision, whose fp16 loss scaler is part of the state.
    """

    precision: Precision

    step: int = 0
    """Optimizer steps taken (restored on resume): ``job.step_count``."""
    epoch: int = 0
    """The epoch in training: ``job.epoch``. ``Job.epochs()`` sets it; without it, the job's
    loader moves to the next epoch when it is iterated again after handing out every sample
    of this one."""
    epochs_driven: bool = False
    """``Job.epochs()`` sets the epochs. A loader iterated twice in one of its epochs then
    repeats that epoch's order (as torch's ``set_epoch`` does) instead of moving on."""
    micro: int = 0
    """Micro-steps done in the open accumulation window (0: none pending)."""
    last_batch: bool = False
    """The batch in training is the epoch's last (it closes the accumulation window)."""
    resumed: bool = False
    """The job has picked up its state (from a checkpoint, or from a live member): objects
    tracked from now on would miss it."""
    resumed_extra: dict[str, object] = field(default_factory=dict)
    """The keyword values given to the ``save()`` the job resumed from."""
    tracked: dict[str, Stateful] = field(default_factory=dict)
    """Objects checkpointed by name with every save (``Job.track``)."""
    scheduler: LRScheduler | None = None
    """The learning-rate scheduler given to ``Job.setup``."""
    sampler: DistributedSampler | ElasticSampler | None = None
    """The sampler of the job's training loader (None before ``Job.loader``)."""

    @property
    def scaler(self) -> AgreedGradScaler | None:
        """fp16's gradient scaler (None in other precisions)."""
        return self.precision.scaler

    def syncs_now(self, grad_accum: int) -> bool:
        """Whether the coming backward closes an accumulation window (gradients sync)."""
        return self.micro + 1 >= grad_accum or self.last_batch
