"""Where a parameter's gradient is, and when it is complete: local autograd or dist autograd.

The reducer hooks each parameter's ``AccumulateGrad`` node, not the tensor: that node's
post-hooks run once its gradient is complete under both engines, local autograd (the gradient
is in ``param.grad``) and ``torch.distributed.autograd`` (the gradient lives in the dist
autograd context and ``param.grad`` is never touched), exactly where torch's C++ reducer hooks
in. Tensor post-accumulate hooks fire only under local autograd.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GradSite", "current_dist_autograd_context", "hook_accumulator"]


def hook_accumulator(param: torch.Tensor, fn: Callable[[], None]) -> tuple[Any, Any]:
    """Run ``fn()`` each time ``param``'s gradient is complete in a backward pass.

    Returns:
        ``(accumulator, handle)``: keep the accumulator alive (autograd holds it weakly and would
        build a new one, without the hook, once it is freed); ``handle.remove()`` detaches.
    """
    with torch.enable_grad():
        node = param.view_as(param).grad_fn
    assert node is not None, "hook_accumulator needs a parameter with requires_grad=True"
    accumulator = node.next_functions[0][0]
    assert accumulator is not None
    handle = accumulator.register_hook(lambda grad_inputs, grad_outputs: fn())
    return accumulator, handle


def current_dist_autograd_context() -> int | None:
    """The id of the ``torch.distributed.autograd`` context this thread is in, if any."""
    rpc = getattr(torch._C, "_distributed_rpc", None)
    if rpc is None or not rpc._is_current_rpc_agent_set():
        return None  # no RPC, so no dist autograd context: a 50 ns check on every forward
    try:
        return int(torch._C._distributed_autograd._current_context()._context_id())
    except RuntimeError:
        return None


class GradSite:
    """Reads and writes the gradients of one backward pass, wherever that pass keeps them."""

    def __init__(self, context_id: int | None = None) -> None:
        self.context_id = context_id

    def get(self, param: torch.Tensor) -> torch.Tensor | None:
        """The accumulated gradient of ``param`` in this pass (``None`` if it has none)."""
        if self.context_id is None:
            return param.grad
        from torch.distributed import autograd as dist_autograd

        return dist_autograd.get_gradients(self.context_id).get(param)

    def set(self, param: torch.Tensor, value: torch.Tensor) -> bool:
        """Make ``value`` the gradient of ``param``; False if the dist autograd context holds
        no gradient for it (it cannot be given one from Python)."""
        if self.context_id is None:
            param.grad = value
            return True
        current = self.get(param)
        if current is None:
            return False
        current.copy_(value)
        return True
