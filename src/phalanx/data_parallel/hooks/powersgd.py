"""PowerSGD: low-rank gradient compression with error feedback and warm start.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019 (Algorithms 1 and 2). Each gradient, viewed as an n×m matrix M (dim 0
× the rest), is replaced by a rank-r approximation found by one step of subspace (power)
iteration: P = M Q, all-reduce P, orthogonalise P, Q = Mᵀ P, all-reduce Q, M̂ = P Qᵀ. Only P and
Q travel: (n + m)·r numbers instead of n·m. Because every step is linear in M once Q is fixed, M̂
equals what one process would compute from the *mean* gradient, and ranks stay bit-identical.

Two ingredients make it converge like SGD: **error feedback** (what compression dropped is added
to the next step's gradient, so nothing is lost, only delayed) and **warm start** (Q is kept
across steps, so the power iteration keeps refining the same subspace).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.data_parallel.grad_bucket import GradBucket
from phalanx.data_parallel.hooks.default import allreduce_future, ddp_compatible

__all__ = ["PowerSGDState", "orthogonalize_", "powerSGD_hook"]

log = logging.getLogger(__name__)


class PowerSGDState:
    """Settings and per-bucket memory of :func:`powerSGD_hook` (torch's argument names).

    Args:
        process_group: Group to average over; None for the default group.
        matrix_approximation_rank: Rank r of the approximation; higher is more accurate and
            sends more (paper: 1-4 suffice for image and language models).
        start_powerSGD_iter: Iterations of plain all-reduce before compressing. Compressing from
            the very first steps hurts accuracy (the paper and torch warm up), and torch's DDP
            rebuilds its buckets after iteration 1, so per-bucket memory must start later.
        min_compression_rate: Compress a gradient only if n·m exceeds this times (n + m)·r;
            others (biases, norms, small layers) are all-reduced exactly, packed together.
        use_error_feedback: Add what compression dropped to the next step's gradient.
        warm_start: Reuse Q from the previous step instead of drawing a fresh random one.
        orthogonalization_epsilon: Added to column norms in Gram-Schmidt (e.g. 1e-8) to damp
            near-zero columns; all-zero columns stay zero even at 0.
        random_seed: Seed of the initial Q; every rank must use the same one.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 10,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
    ) -> None:
        _require(
            matrix_approximation_rank >= 1,
            "matrix_approximation_rank",
            ">= 1",
            matrix_approximation_rank,
        )
        _require(start_powerSGD_iter >= 0, "start_powerSGD_iter", ">= 0", start_powerSGD_iter)
        # torch's DDP rebuilds its buckets after the first iteration, which would misalign any
        # per-bucket memory created before.
        _require(
            start_powerSGD_iter >= 2 or not (use_error_feedback or warm_start),
            "start_powerSGD_iter",
            ">= 2 when use_error_feedback or warm_start is on",
            start_powerSGD_iter,
        )
        _require(min_compression_rate > 0, "min_compression_rate", "> 0", min_compression_rate)
        _require(
            orthogonalization_epsilon >= 0,
            "orthogonalization_epsilon",
            ">= 0",
            orthogonalization_epsilon,
        )
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = random_seed
        self.iter = 0
        self.error_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self._shapes: dict[int, tuple[tuple[int, ...], ...]] = {}

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count one iteration when the last bucket of a backward pass has been handed over."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                log.info("PowerSGD starts compressing after %d iterations", self.iter)


def _require(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {name}={value!r}")


@dataclass(frozen=True)
class _Matrix:
    offset: int
    n: int
    m: int
    r: int


@dataclass(frozen=True)
class _Plan:
    matrices: list[_Matrix]
    plain: list[tuple[int, int]]  # (offset, numel) of gradients sent uncompressed

    @property
    def p_numel(self) -> int:
        return sum(x.n * x.r for x in self.matrices)

    @property
    def q_numel(self) -> int:
        return sum(x.m * x.r for x in self.matrices)


def plan_compression(
    shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float
) -> _Plan:
    """Split a bucket's gradients into matrices worth compressing and plain tensors (pure)."""
    matrices, plain, offset = [], [], 0
    for shape in shapes:
        numel = math.prod(shape)
        n = shape[0] if len(shape) >= 2 else numel
        m = numel // n if n else 0
        r = min(rank, n, m)
        if len(shape) >= 2 and (n + m) * r * min_compression_rate < n * m:
            matrices.append(_Matrix(offset, n, m, r))
        elif numel:
            plain.append((offset, numel))
        offset += numel
    return _Plan(matrices, plain)


def orthogonalize_(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Make the columns of ``matrix`` (n×r, r <= n) orthonormal in place by Gram-Schmidt.

    Modified Gram-Schmidt: each column is normalised, then removed from the later columns.
    An all-zero column (a gradient that vanished) stays zero rather than becoming NaN.
    """
    tiny = torch.finfo(matrix.dtype).tiny
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        col.div_(col.norm().clamp_min(tiny) + epsilon)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(col @ (col.t() @ rest))  # [n,1] @ ([1,n] @ [n,r-i-1])
    return matrix


@ddp_compatible
def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients through rank-r PowerSGD approximations.

    For the first ``state.start_powerSGD_iter`` iterations this is a plain all-reduce. The
    collectives then run synchronously and the returned future is already complete.

    Args:
        state: Settings and per-bucket memory, shared by every call of the hook.
        bucket: The bucket of local gradients.

    Returns:
        A future whose value is the averaged (approximated) buffer.
    """
    compress = state.iter >= state.start_powerSGD_iter
    state.maybe_increase_iter(bucket)
    if not compress:
        return allreduce_future(state.process_group, bucket.buffer())
    buffer = bucket.buffer()
    _compress_bucket(state, bucket.index(), [tuple(g.shape) for g in bucket.gradients()], buffer)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def _compress_bucket(
    state: PowerSGDState, index: int, shapes: list[tuple[int, ...]], buffer: torch.Tensor
) -> None:
    """Replace ``buffer`` (local gradients) by the group's low-rank average, in place."""
    group, size = state.process_group, dist.get_world_size(state.process_group)
    if sum(math.prod(s) for s in shapes) != buffer.numel():
        raise ValueError(
            f"bucket {index}: gradients of shapes {shapes} do not fill its buffer "
            f"of {buffer.numel()} elements"
        )
    plan = plan_compression(shapes, state.matrix_approximation_rank, state.min_compression_rate)
    _reset_if_rebuilt(state, index, tuple(shapes))
    error = _add_error_feedback(state, index, buffer)
    # Start the exact all-reduce of the small tensors first so it overlaps the matmuls below.
    plain = torch.cat([buffer[o : o + k] for o, k in plan.plain]) if plan.plain else None
    plain_work = c.all_reduce(plain, group=group, async_op=True) if plain is not None else None
    if error is not None:
        error.copy_(buffer)  # M, until M̂ is subtracted in _finish
    if plan.matrices:
        _low_rank_average(state, index, plan, buffer, group, size)
    if plain is not None and plain_work is not None:
        plain_work.wait()
        _unpack(plain.div_(size), plan.plain, buffer)
    _finish(state, index, plan, buffer, error)


def _low_rank_average(
    state: PowerSGDState,
    index: int,
    plan: _Plan,
    buffer: torch.Tensor,
    group: dist.ProcessGroup | None,
    size: int,
) -> None:
    """One power-iteration step per matrix (Algorithm 1); writes M̂ = P Qᵀ into ``buffer``."""
    eps = state.orthogonalization_epsilon
    mats = [buffer[x.offset : x.offset + x.n * x.m].view(x.n, x.m) for x in plan.matrices]
    q_flat = _q_memory(state, index, plan, buffer)
    p_flat = buffer.new_empty(plan.p_numel)
    ps, qs = _views(p_flat, plan, "n"), _views(q_flat, plan, "m")
    for mat, p, q in zip(mats, ps, qs):
        # Orthogonalising the warm-started Q does not change span(M Q) but keeps the columns
        # of P well separated for Gram-Schmidt (torch does the same).
        torch.matmul(mat, orthogonalize_(q, eps), out=p)  # [n,m] @ [m,r]
    c.all_reduce(p_flat, group=group)  # a sum: P is orthogonalised next, so its scale is moot
    for mat, p, q in zip(mats, ps, qs):
        torch.matmul(mat.t(), orthogonalize_(p, eps), out=q)  # [m,n] @ [n,r]
    c.all_reduce(q_flat, group=group)
    q_flat.div_(size)  # Q = mean(M)ᵀ P, the same on every rank
    for mat, p, q in zip(mats, ps, qs):
        torch.matmul(p, q.t(), out=mat)  # M̂ = P Qᵀ: [n,r] @ [r,m]


def _finish(
    state: PowerSGDState, index: int, plan: _Plan, buffer: torch.Tensor, error: torch.Tensor | None
) -> None:
    if error is not None:
        # e = M − M̂ is what compression dropped (Algorithm 2). Plain tensors were sent exactly,
        # so their error is zero, not "local minus mean" (which would only random-walk).
        error.sub_(buffer)
        for o, k in plan.plain:
            error[o : o + k].zero_()
    if not state.warm_start:
        state.q_memory_dict.pop(index, None)


def _reset_if_rebuilt(
    state: PowerSGDState, index: int, shapes: tuple[tuple[int, ...], ...]
) -> None:
    """Drop a bucket's memory when its layout changed (DDP rebuilt its buckets)."""
    if state._shapes.get(index, shapes) != shapes:
        log.warning("PowerSGD: bucket %d changed layout; its error and Q memory restart", index)
        state.error_dict.pop(index, None)
        state.q_memory_dict.pop(index, None)
    state._shapes[index] = shapes


def _add_error_feedback(
    state: PowerSGDState, index: int, buffer: torch.Tensor
) -> torch.Tensor | None:
    if not state.use_error_feedback:
        return None
    error = state.error_dict.get(index)
    if error is None:
        error = state.error_dict[index] = torch.zeros_like(buffer)
    buffer.add_(error)  # M = g + e
    return error


def _q_memory(state: PowerSGDState, index: int, plan: _Plan, like: torch.Tensor) -> torch.Tensor:
    """The bucket's flat Q memory: kept from the last step (warm start) or freshly random."""
    q = state.q_memory_dict.get(index)
    if q is None:
        # Same seed on every rank so the ranks' Ps are projections onto the same subspace; a
        # CPU generator keeps the draw identical whatever the device.
        key = (state.random_seed, index, 0 if state.warm_start else state.iter)
        gen = torch.Generator().manual_seed(hash(key) & 0x7FFF_FFFF_FFFF_FFFF)
        q = torch.randn(plan.q_numel, generator=gen, dtype=like.dtype).to(like.device)
        state.q_memory_dict[index] = q
    return q


def _views(flat: torch.Tensor, plan: _Plan, rows: str) -> list[torch.Tensor]:
    out, offset = [], 0
    for x in plan.matrices:
        k = getattr(x, rows)
        out.append(flat[offset : offset + k * x.r].view(k, x.r))
        offset += k * x.r
    return out


def _unpack(flat: torch.Tensor, spans: list[tuple[int, int]], buffer: torch.Tensor) -> None:
    offset = 0
    for o, k in spans:
        buffer[o : o + k].copy_(flat[offset : offset + k])
        offset += k
