"""``Job.clip_grad_norm_``: clip by the whole model's norm, for every strategy.

In fp16 the gradients are unscaled first (the scaler's ``unscale_``, once per step: ``step()``
then does not unscale again), where this rank holds them (ZeRO-2's reduced ranges included),
with the overflow check agreed over the ranks (``train/grad_scaler.py``). The norm spans every
rank's part where parameters are split: ZeRO-1/2's optimizer ranges, ZeRO-3's flat shards, a
mesh's pipeline stages and tensor shards (collective there: every rank calls it); the
strategy's runner computes it. On a micro-step whose gradients are still accumulating
(``grad_accum``) nothing is clipped and NaN is returned: clip on the step where ``step()`` will
return True.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from phalanx.train.job_args import check_clip

if TYPE_CHECKING:  # the job calls this with itself; no import at run time
    from phalanx.train.job import Job

__all__ = ["clip"]


def clip(job: Job, max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip ``job``'s gradients to ``max_norm``; the total norm before clipping (a tensor).

    Raises:
        ValueError: a parameter-server strategy (the servers apply each worker's own
            gradient), no model set up, or a bad ``max_norm`` / ``norm_type``.
    """
    max_norm, norm_type = check_clip(max_norm, norm_type)
    if job.model is None:
        raise ValueError("Job.clip_grad_norm_() needs Job.setup(model, ...) first")
    if not job.state.syncs_now(job.grad_accum):
        return torch.tensor(float("nan"))
    if job.precision.scaler is not None:
        if job.optimizer is None:
            raise ValueError("Job.clip_grad_norm_() in fp16 needs the optimizer in setup()")
        job.precision.unscale_(job.optimizer, job.runner.grad_shards(job.optimizer))
    return job.runner.clip_grad_norm_(max_norm, norm_type)
