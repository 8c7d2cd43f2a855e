"""SyncBatchNorm: batch normalisation whose statistics span every rank of a process group.

Plain BatchNorm (Ioffe & Szegedy, 2015) normalises with the statistics of the local batch; under
data parallelism each rank then sees only ``B / world_size`` samples, which is noisy for small
per-GPU batches (detection, segmentation). SyncBatchNorm computes mean and variance over the
*global* batch instead, at the price of one small all-reduce in forward and one in backward:

* forward: each rank packs ``[sum x (C), sum x² (C), count (1)]``; one all-reduce gives the global
  mean and (biased) variance. Counts travel with the sums, so per-rank batch sizes may differ and a
  rank with an empty batch still takes part (contributing zeros) so nobody hangs.
* backward: the input gradient needs the global ``sum dy`` and ``sum dy·x̂`` per channel (one
  all-reduce of ``[2C]``); the weight and bias gradients stay local sums, averaged later by data
  parallel exactly as for any other parameter (the same contract as ``torch.nn.SyncBatchNorm``).

Unlike torch's, this one runs on CPU tensors (gloo) as well as CUDA (NCCL). Without an initialised
group, with a world of one, or in eval mode it is exactly ``BatchNorm`` (no communication).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from phalanx._check import (
    FLAG,
    GROUP,
    MODULE,
    check_float,
    check_int,
    checked,
    optional,
    rule,
)
from phalanx.comm.collectives import all_reduce

__all__ = ["SyncBatchNorm"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _wide_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; everywhere else the tiny [2C+1] packet is worth carrying in float64.
    return torch.float32 if device.type == "mps" else torch.float64


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp16/bf16 input is normalised in fp32; fp32 and fp64 in their own precision."""
    return torch.promote_types(x.dtype, torch.float32)


def _local_moments(x: torch.Tensor) -> torch.Tensor:
    """Pack this rank's ``[sum x (C), sum x² (C), count (1)]`` for one all-reduce.

    Per-rank moments use the stable two-pass method in at least fp32 (mean, then the sum of
    squared deviations ``M2``) and only then become raw power sums, in float64: the global
    variance ``E[x²] − E[x]²`` is a difference of large numbers, and float64 keeps that
    cancellation harmless (Chan, Golub & LeVeque 1979 on why one-pass sums lose precision).
    """
    channels, count = x.size(1), x.numel() // x.size(1)
    wide = _wide_dtype(x.device)
    if count == 0:
        return torch.zeros(2 * channels + 1, dtype=wide, device=x.device)
    dims = _reduce_dims(x)
    mean = x.mean(dims, dtype=_compute_dtype(x))
    dev = x - mean.view(1, -1, *([1] * (x.dim() - 2)))  # promotes fp16/bf16 to fp32
    # mul_ in place: on CPU one large temporary is much cheaper than two (and than var_mean).
    m2 = dev.mul_(dev).sum(dims).to(wide)
    mean = mean.to(wide)
    sums = mean * count
    return torch.cat([sums, m2 + sums * mean, sums.new_tensor([float(count)])])


def _global_moments(packed: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Unpack the all-reduced packet into global mean, biased variance and count."""
    sums, sumsq, count = packed[:channels], packed[channels:-1], int(packed[-1].item())
    n = max(count, 1)  # an all-empty global batch: avoid 0/0; the caller skips the update
    mean = sums / n
    var = (sumsq / n - mean * mean).clamp_min_(0)
    return mean, var, count


def _update_running(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    count: int,
    factor: float,
) -> None:
    # Running variance is the unbiased estimate n/(n-1)·var, as torch's BatchNorm keeps it.
    unbiased = var * (count / (count - 1))
    running_mean.lerp_(mean.to(running_mean.dtype), factor)
    running_var.lerp_(unbiased.to(running_var.dtype), factor)


def _as(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _local_grad_sums(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's per-channel ``Σ dy`` and ``Σ dy·x̂`` in one fused pass.

    Eval-mode batch-norm backward with the global statistics in the running-stats slots returns
    exactly these as the bias and weight gradients.
    """
    if x.numel() == 0:  # the fused kernel divides by the element count (SIGFPE on CPU)
        zeros = torch.zeros(x.size(1), dtype=mean.dtype, device=x.device)
        return zeros, zeros.clone()
    mask = [False, True, True]
    _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
        dy, x, weight, mean, var, None, None, False, eps, mask
    )
    return sum_dy, sum_dy_xhat


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm over the global batch; one all-reduce in forward, one in backward.

    Once the global statistics are known, the elementwise work is torch's own fused eval-mode
    batch norm (forward, and the ``x̂`` term of the input gradient) and its backward (the sums),
    so the only extra cost over local BatchNorm is the two small all-reduces.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        factor: float,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        packed = _local_moments(x)
        all_reduce(packed, group=group)
        mean, var, count = _global_moments(packed, x.size(1))
        if count == 1:  # every rank sees the same global count, so all raise together
            raise ValueError(
                "Expected more than 1 value per channel when training, got a global batch "
                f"of 1 value per channel (local input shape {tuple(x.shape)})"
            )
        if running_mean is not None and running_var is not None and count > 0:
            _update_running(running_mean, running_var, mean, var, count, factor)
        dtype = _compute_dtype(x)  # fp16/bf16 x: fp32 statistics and affine parameters
        mean, var, w = mean.to(dtype), var.to(dtype), _as(weight, dtype)
        ctx.save_for_backward(x, w, mean, var)
        ctx.count, ctx.group, ctx.eps = count, group, eps
        ctx.param_dtype = x.dtype if weight is None else weight.dtype
        return F.batch_norm(x, mean, var, w, _as(bias, dtype), False, 0.0, eps)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, var = ctx.saved_tensors
        sum_dy, sum_dy_xhat = _local_grad_sums(dy, x, weight, mean, var, ctx.eps)
        # Weight and bias gradients stay local: data parallel sums/averages them like any other.
        grad_w = sum_dy_xhat.to(ctx.param_dtype) if ctx.needs_input_grad[1] else None
        grad_b = sum_dy.to(ctx.param_dtype) if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _input_grad(ctx, dy, x, weight, mean, var, sum_dy, sum_dy_xhat)
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _input_grad(
    ctx: Any,
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    sum_dy: torch.Tensor,
    sum_dy_xhat: torch.Tensor,
) -> torch.Tensor:
    """dx = (w·invstd / N)·(N·dy − Σdy − x̂·Σ(dy·x̂)), the sums taken over the global batch.

    Written as ``a·dy + (x̂·(−a·Σ(dy·x̂)/N) − a·Σdy/N)`` with ``a = w·invstd``: the bracket is an
    eval-mode batch norm of ``x`` with weight ``−a·Σ(dy·x̂)/N`` and bias ``−a·Σdy/N`` (one fused
    pass that subtracts the mean first, so no cancellation), then one ``addcmul_``.
    """
    channels = x.size(1)
    packed = torch.cat([sum_dy, sum_dy_xhat])
    all_reduce(packed, group=ctx.group)  # empty local batches still join: zeros, no hang
    n = max(ctx.count, 1)
    mean_dy, mean_dy_xhat = packed[:channels] / n, packed[channels:] / n
    a = torch.rsqrt(var + ctx.eps)
    if weight is not None:
        a = a * weight
    grad = F.batch_norm(x, mean, var, -a * mean_dy_xhat, -a * mean_dy, False, 0.0, ctx.eps)
    return grad.addcmul_(dy, a.view(1, -1, *([1] * (x.dim() - 2))))


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch normalisation with statistics over the whole process group; any device.

    A drop-in for ``torch.nn.SyncBatchNorm`` (same constructor and ``convert_sync_batchnorm``)
    that also runs on CPU tensors with gloo. Accepts ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)``
    and ``(N, C, D, H, W)`` input, channels-last included; fp16/bf16 input is normalised with
    fp32 statistics.

    Args:
        num_features: Number of channels ``C`` (dim 1 of the input).
        eps: Added to the variance for numerical stability.
        momentum: Running-statistics factor; ``None`` for a cumulative average.
        affine: Learn a per-channel weight and bias.
        track_running_stats: Keep running mean and variance for eval mode.
        process_group: Group to synchronise over; ``None`` for the default (world) group.
        device: Device of the parameters and buffers.
        dtype: Dtype of the parameters and buffers.
        bias: With ``affine``, also learn the bias (torch >= 2.13 spelling).
    """

    @checked(
        num_features=rule(check_int, min=1),
        eps=rule(check_float, min=0),
        momentum=optional(rule(check_float, min=0, max=1, fix="or None (cumulative average)")),
        affine=FLAG,
        track_running_stats=FLAG,
        process_group=GROUP,
        bias=FLAG,
    )
    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
    ) -> None:
        # Only torch >= 2.13 knows `bias=`; pass it when it differs from the default.
        extra: dict[str, Any] = {} if bias else {"bias": False}
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device, dtype, **extra
        )
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2 or input.size(1) != self.num_features:
            raise ValueError(
                f"SyncBatchNorm(num_features={self.num_features}) expected input of shape "
                f"(N, {self.num_features}, ...) with at least 2 dims, got {tuple(input.shape)}; "
                "the channel dim must be dim 1"
            )

    def _needs_sync(self) -> bool:
        """Training with a group of more than one rank (eval and single rank: plain BatchNorm)."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self.process_group) > 1  # -1 for a non-member: local

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` with global batch statistics (training) or running ones (eval)."""
        if not self._needs_sync():
            return super().forward(input)  # plain BatchNorm: checks input, updates stats
        self._check_input_dim(input)
        factor = self._momentum_factor()
        track = self.track_running_stats
        return _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if track else None,
            self.running_var if track else None,
            self.eps,
            factor,
            self.process_group,
        )

    def _momentum_factor(self) -> float:
        """Count this batch and return the running-stats factor, as ``_BatchNorm`` does."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    @classmethod
    @checked(module=MODULE, process_group=GROUP)
    def convert_sync_batchnorm(
        cls, module: nn.Module, process_group: dist.ProcessGroup | None = None
    ) -> nn.Module:
        """Replace every BatchNorm layer in ``module`` (recursively) by a SyncBatchNorm.

        The new layers share the old layers' parameters and buffers (same tensors, so weights,
        running statistics, ``num_batches_tracked`` and ``requires_grad`` carry over) and their
        training flag. Returns ``module`` itself, or the new layer if ``module`` is a BatchNorm.
        """
        converted = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            converted = _sync_copy(cls, module, process_group)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted


def _sync_copy(
    cls: type[SyncBatchNorm],
    bn: nn.modules.batchnorm._BatchNorm,
    process_group: dist.ProcessGroup | None,
) -> SyncBatchNorm:
    sync = cls(
        bn.num_features,
        bn.eps,
        bn.momentum,
        bn.affine,
        bn.track_running_stats,
        process_group,
        bias=not bn.affine or bn.bias is not None,
    )
    if bn.affine:
        sync.weight, sync.bias = bn.weight, bn.bias
    sync.running_mean, sync.running_var = bn.running_mean, bn.running_var
    sync.num_batches_tracked = bn.num_batches_tracked
    sync.training = bn.training
    if hasattr(bn, "qconfig"):
        sync.qconfig = bn.qconfig
    return sync
