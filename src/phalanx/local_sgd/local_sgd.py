"""LocalSGD: every rank steps its own optimizer; every H steps the replicas are averaged.

Stich, "Local SGD converges fast and communicates little" (2019); Lin et al., "Don't use large
mini-batches, use local SGD" (2020). With H = 1 and plain SGD the average of the stepped
replicas is the step on the averaged gradient (SGD is linear in the gradient), i.e. DDP, up to
floating-point rounding. The parameters and floating-point buffers go out in flat buckets of
``bucket_bytes`` (:func:`phalanx.mesh.replica_average.average_tensors`, DDP's bucket engine).
With ``late_policy="weighted"`` and unequal step counts, each replica weighs by the steps it
took this round (:mod:`.late`), summed in float32.
"""

from __future__ import annotations

from phalanx.local_sgd.periodic import PeriodicSync
from phalanx.local_sgd.replicas import nbytes
from phalanx.mesh.replica_average import average_tensors

__all__ = ["LocalSGDSync"]


class LocalSGDSync(PeriodicSync):
    """Average the parameters and floating-point buffers over the group every H steps."""

    def sync(self, weights: list[float] | None = None) -> int:
        tensors = self.replica.param_tensors + self.replica.buffer_tensors
        if weights is not None:
            return self.weighted_mean(tensors, weights)
        sent = average_tensors(tensors, self.group, self.bucket_bytes)  # buckets; 0 alone
        return nbytes(tensors) if sent else 0
