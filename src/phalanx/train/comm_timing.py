"""Communication wait of torch's own strategies, for the job's phase clock.

phalanx's strategies wait on communication inside :func:`phalanx.comm.wait_clock.blocked`
(tracked works, blocking collectives, DDP's bucket futures, pipeline receives). torch's DDP,
ZeroRedundancyOptimizer and FSDP2 wait in their own code, some of it C++; what is measured, and
where:

- **torch DDP** (``"torch-ddp"``, ``"torch-zero1"``): a communication hook equal to torch's
  default (``allreduce_hook``: divide by the world size, all-reduce the bucket) that notes when
  the last bucket of an iteration is launched, which is when backward's computation is done;
  DDP's reducer then blocks until every bucket's future completes. The wait is from the last
  launch to the last completion. A hook the user registers afterwards
  (``model.register_comm_hook(state, hook)``) takes the default's place and is timed the same
  way; torch's C++ built-in hooks (``_register_builtin_comm_hook``) cannot be added on top.
  Buffer broadcasts in forward (``broadcast_buffers``, models with buffers) are not timed.
- **torch ZeroRedundancyOptimizer** (``"torch-zero1"``): the parameter broadcasts that follow
  the local step (its ``_sync_params``), timed whole.
- **torch FSDP2** (``"torch-fsdp"``): the all-gather and reduce-scatter it issues, through its
  custom-collective hooks (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) with
  torch's default implementation. On CPU (gloo) FSDP2 issues them synchronously, so the call is
  the wait; on an accelerator it issues them on side streams and the call is only the launch.

Where a torch version lacks the private hook used here, a warning says that strategy's wait is
not measured, and ``Job.summary()["comm_share"]`` is NaN (not a silent 0).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import wait_clock

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["time_torch_ddp", "time_torch_fsdp", "time_torch_zero"]

log = logging.getLogger(__name__)


def _not_measured(what: str, exc: BaseException | None = None) -> None:
    reason = f" ({exc})" if exc is not None else ""
    log.warning(
        "rank %d: %s is not measured with torch %s%s; Job.summary()['comm_share'] and the "
        "straggler detector count it as compute",
        dist.get_rank() if dist.is_initialized() else 0,
        what,
        torch.__version__,
        reason,
    )


class _DDPWait:
    """Times the wait at the end of torch DDP's backward around its communication hook."""

    def __init__(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.hook: Any = allreduce_hook
        self.state: Any = None
        self.user_hook = False
        self._lock = threading.Lock()
        self._last_launch: float | None = None
        self._counted = 0.0

    def launch(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        now = time.perf_counter()
        with self._lock:
            if bucket.index() == 0:  # torch launches buckets in index order: a new iteration
                self._last_launch, self._counted = None, 0.0
            if bucket.is_last():
                self._last_launch = now
        fut: torch.futures.Future[torch.Tensor] = self.hook(self.state, bucket)
        return fut.then(self._done)

    def _done(self, fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        now = time.perf_counter()
        with self._lock:
            if self._last_launch is not None:
                waited = now - self._last_launch
                if waited > self._counted:  # the wait ends with the last future to complete
                    wait_clock.add(waited - self._counted)
                    self._counted = waited
        return fut.value()

    def register(self, state: object, hook: Any) -> None:
        """What ``model.register_comm_hook`` does once this timer is installed."""
        if self.user_hook:
            raise RuntimeError(
                "register_comm_hook can only be called once (torch DDP's rule); this model "
                "already has a hook"
            )
        self.hook, self.state, self.user_hook = hook, state, True


def time_torch_ddp(model: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Install the timing hook on a ``torch.nn.parallel.DistributedDataParallel``; True: timed."""
    timer = _DDPWait()

    def timed_allreduce(
        state: object, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        return timer.launch(bucket)

    # torch checks the hook's annotations against the classes themselves (not strings)
    timed_allreduce.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    model.register_comm_hook(None, timed_allreduce)
    model.register_comm_hook = timer.register  # type: ignore[method-assign]
    return True


def time_torch_zero(optimizer: ZeroRedundancyOptimizer) -> bool:
    """Time torch ZeroRedundancyOptimizer's parameter broadcasts; True: timed."""
    # A private method of torch's (no public hook exists): where a torch version lacks it,
    # the wait is said to be not measured rather than read as 0.
    sync = getattr(optimizer, "_sync_params", None)
    if not callable(sync):
        _not_measured("torch ZeroRedundancyOptimizer's parameter broadcast")
        return False

    @functools.wraps(sync)
    def timed(*args: Any, **kwargs: Any) -> Any:
        with wait_clock.blocked():
            return sync(*args, **kwargs)

    optimizer._sync_params = timed  # type: ignore[attr-defined]
    return True


def time_torch_fsdp(model: nn.Module) -> bool:
    """Time FSDP2's all-gathers and reduce-scatters on every ``fully_shard`` module of ``model``;
    True: timed."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc
    except ImportError as exc:
        _not_measured("FSDP2's communication", exc)
        return False

    class TimedAllGather(fc.DefaultAllGather):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with wait_clock.blocked():
                return super().__call__(*args, **kwargs)

    class TimedReduceScatter(fc.DefaultReduceScatter):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with wait_clock.blocked():
                return super().__call__(*args, **kwargs)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(TimedAllGather())
            module.set_custom_reduce_scatter(TimedReduceScatter())
    return True
