"""DiLoCo: H inner steps alone, then an outer Nesterov step on the averaged pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023),
Algorithm 1. Every rank keeps the global parameters θ of the last outer step. After H inner
steps (the user's optimizer, typically AdamW) the pseudo-gradient Δ = θ − θ_local is averaged
over the replicas, the outer optimizer (SGD with Nesterov momentum) steps θ with Δ as its
gradient, and every replica restarts from the new θ. The inner optimizer's state is kept.

With H = 1, outer lr 1 and no momentum, θ − 1·mean(θ − θ_i) is the mean of the replicas after
one step each: for plain SGD that is DDP's step, up to floating-point rounding.

The outer optimizer is ``torch.optim.SGD`` over the global parameters (the pseudo-gradient as
their ``.grad``, :mod:`.outer`). θ and the momentum are checkpointed
(:meth:`DiLoCoSync.shared_state`). The pseudo-gradient travels in float32 or quantised
(:mod:`.pending_average`); the buffers are averaged in their dtype.

With ``late_policy="weighted"`` (:mod:`.late`) a round ends when the first replica has taken
H inner steps; the pseudo-gradients (and buffers) are weighted by the inner steps each replica
took, so a late replica's shorter walk counts for less and the others never wait long for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx._check import check_instance
from phalanx.local_sgd.outer import Outer
from phalanx.local_sgd.pending_average import PendingAverage
from phalanx.local_sgd.periodic import DEFAULT_BUCKET_BYTES, PeriodicSync
from phalanx.local_sgd.replicas import Replica, nbytes
from phalanx.mesh.replica_average import average_tensors

__all__ = ["DiLoCoSync"]

GLOBAL = ""
"""θ is saved under the parameters' own names: ``checkpoint.load(path, model=plain_model,
strict=False)`` loads the global model of a DiLoCo checkpoint (the rest is prefixed)."""
MOMENTUM = "momentum/"


class DiLoCoSync(PeriodicSync):
    """DiLoCo's outer loop around the user's (inner) optimizer.

    Args:
        replica: This rank's parameters and buffers (equal on every rank when built).
        group: The replicas' process group (None: every rank).
        every: Inner steps per outer step (H, >= 1).
        outer: The outer optimizer and codec (:class:`.Outer`).
        bucket_bytes: Cap of each flat all-reduce bucket.
        late_policy: "wait" or "weighted" (:class:`.PeriodicSync`).
    """

    def __init__(
        self,
        replica: Replica,
        group: dist.ProcessGroup | None,
        every: int,
        outer: Outer,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        late_policy: str = "wait",
    ) -> None:
        super().__init__(replica, group, every, bucket_bytes, late_policy)
        self.options = check_instance(
            "outer", outer, Outer, "a phalanx.local_sgd.Outer", where=type(self).__name__
        )
        self.global_params = [t.clone() for t in replica.param_tensors]
        """θ: the parameters of the last outer step (equal on every rank)."""
        self.outer = outer.optimizer(self.global_params)

    def pseudo_gradient(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """Δ = θ − θ_local of the parameters at ``indices``, on this rank (new tensors)."""
        local = self.replica.param_tensors
        return [self.global_params[i] - local[i] for i in indices]

    def launch(
        self, deltas: list[torch.Tensor], weights: list[float] | None = None
    ) -> PendingAverage:
        """Start averaging ``deltas`` over the group in the outer codec (in place on wait),
        weighted by ``weights`` (one per rank) if given."""
        o = self.options
        return PendingAverage(deltas, self.group, o.codec, o.block, self.bucket_bytes, weights)

    def average_buffers(self, weights: list[float] | None = None) -> int:
        """Average the floating-point buffers (no outer step: they have no gradient)."""
        buffers = self.replica.buffer_tensors
        if weights is not None:
            return self.weighted_mean(buffers, weights) if buffers else 0
        sent = average_tensors(buffers, self.group, self.bucket_bytes)  # buckets; 0 alone
        return nbytes(buffers) if sent else 0

    def sync(self, weights: list[float] | None = None) -> int:
        every = range(len(self.global_params))
        deltas = self.pseudo_gradient(every)
        pending = self.launch(deltas, weights)
        pending.wait()
        self.outer_step(every, deltas)
        return pending.sent_bytes + self.average_buffers(weights)

    def final_sync(self, weights: list[float] | None = None) -> int:
        """The end of training (:meth:`flush`): θ becomes the replicas' average, with no
        outer step. The outer momentum is that of full H-step rounds; stepped once more on a
        partial round's pseudo-gradient it overshoots (streaming DiLoCo's fragments always end
        part-way: its final loss on ``phalanx bench low_bandwidth`` was 2.1% over DDP's)."""
        local = self.replica.param_tensors
        if weights is not None:
            sent = self.weighted_mean(local, weights)
        else:
            sent = nbytes(local) if average_tensors(local, self.group, self.bucket_bytes) else 0
        for theta, averaged in zip(self.global_params, local):
            theta.copy_(averaged)
        return sent + self.average_buffers(weights)

    def outer_step(self, indices: Sequence[int], averaged: list[torch.Tensor]) -> None:
        """Step θ at ``indices`` with the averaged pseudo-gradient (torch's SGD skips the
        parameters without one); those local parameters restart from θ."""
        local = self.replica.param_tensors
        for i, delta in zip(indices, averaged):
            self.global_params[i].grad = delta
        self.outer.step()
        for i in indices:
            self.global_params[i].grad = None
            local[i].copy_(self.global_params[i])

    def shared_state(self) -> dict[str, torch.Tensor]:
        """θ (by parameter name) and the outer momentum (``momentum/<name>``, once it exists)."""
        out: dict[str, torch.Tensor] = {}
        for (name, _), theta in zip(self.replica.params, self.global_params):
            out[GLOBAL + name] = theta
            buf = self.outer.state.get(theta, {}).get("momentum_buffer")
            if buf is not None:
                out[MOMENTUM + name] = buf
        return out

    def load_shared_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.outer.state.clear()
        for (name, _), theta in zip(self.replica.params, self.global_params):
            if GLOBAL + name not in tensors:
                raise ValueError(f"the checkpoint holds no DiLoCo global parameter {name!r}")
            theta.copy_(tensors[GLOBAL + name].view_as(theta))
            if MOMENTUM + name in tensors:
                buf = tensors[MOMENTUM + name].to(theta.dtype).view_as(theta).clone()
                self.outer.state[theta] = {"momentum_buffer": buf}
