"""Communication hooks: what a data-parallel bucket sends instead of a plain fp32 all-reduce.

Every hook is ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]`` (the contract of
:mod:`phalanx.data_parallel.grad_bucket`, identical to torch's ``register_comm_hook``), so they run
on phalanx's engine and on ``torch.nn.parallel.DistributedDataParallel`` alike::

    ddp.register_comm_hook(PowerSGDState(matrix_approximation_rank=2), powerSGD_hook)

=====================  ==================  ==========================================
hook                   state               bytes sent per rank (n gradient entries)
=====================  ==================  ==========================================
allreduce_hook         process group/None  4n (fp32), exact mean
fp16_compress_hook     process group/None  2n, ~3 significant digits
bf16_compress_hook     process group/None  2n, ~2 significant digits, fp32 range
powerSGD_hook          PowerSGDState       4(n_i + m_i)r per n_i×m_i matrix + small tensors
topk_hook              TopKState           k values + k int32 indices, k = ⌈ratio·n⌉
=====================  ==================  ==========================================
"""

from __future__ import annotations

from phalanx.data_parallel.hooks.default import (
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from phalanx.data_parallel.hooks.powersgd import PowerSGDState, powerSGD_hook
from phalanx.data_parallel.hooks.topk import TopKState, topk_hook

__all__ = [
    "PowerSGDState",
    "TopKState",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "powerSGD_hook",
    "topk_hook",
]
