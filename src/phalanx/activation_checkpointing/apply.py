"""Install the recomputation: each selected block's ``forward`` runs under torch's checkpoint.

A block keeps its class, its name and its place in the model: only its ``forward`` is replaced,
by a method bound to the block (an instance attribute), which calls the class's ``forward``
through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. So state dicts,
parameter names, a strategy's wrapping (ZeRO-3 units, tensor-parallel layers, pipeline stages)
and ``copy.deepcopy`` (a bound method is copied bound to the copy) see the model unchanged; the
block's own forward hooks run once, around the recomputed region, not again in backward.

Non-reentrant checkpointing only: it works with keyword arguments, with inputs that need no
gradient, with DDP's and ZeRO's gradient hooks, and restores the random generators (dropout
recomputes the same mask) and autocast. Collectives inside a block run again in its
recomputation (in place, as torch's c10d collectives are, they cannot be served from a
selective block's kept results). Without gradients (``torch.no_grad()``, evaluation) a
block runs as it would without checkpointing.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from phalanx._check import check_module
from phalanx.activation_checkpointing.policy import (
    ActivationCheckpointing,
    select_blocks,
    to_policy,
)

__all__ = ["checkpoint_activations", "checkpointed_blocks"]

_CONTEXT = "_phalanx_ac_context"
"""The attribute of a checkpointed block holding its ``context_fn`` (None for full AC)."""


def checkpoint_activations(
    model: nn.Module, policy: ActivationCheckpointing | str = "full"
) -> list[str]:
    """Checkpoint the activations of ``model``'s blocks in place; return the blocks' names.

    Args:
        model: Any ``nn.Module``; apply before a strategy wraps it (``phalanx.Job`` does, given
            ``Job(activation_checkpointing=...)``).
        policy: "full", "selective" or an :class:`phalanx.ActivationCheckpointing`.

    Raises:
        ValueError: The model has no block to checkpoint, or one of them already is.
    """
    check_module("model", model, where="checkpoint_activations")
    resolved = to_policy(policy, where="checkpoint_activations")
    assert resolved is not None
    blocks = select_blocks(model, resolved)
    done = [name for name, block in blocks if hasattr(block, _CONTEXT)]
    if done:
        raise ValueError(
            f"checkpoint_activations: block {done[0]!r} of {type(model).__name__} is "
            "checkpointed already; apply activation checkpointing once"
        )
    context = _selective_context(resolved) if resolved.mode == "selective" else None
    for _, block in blocks:
        setattr(block, _CONTEXT, context)
        block.forward = types.MethodType(_checkpointed_forward, block)
    return [name for name, _ in blocks]


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Names of ``model``'s submodules whose activations are checkpointed."""
    return [name for name, m in model.named_modules() if hasattr(m, _CONTEXT)]


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = functools.partial(type(self).forward, self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    context = getattr(self, _CONTEXT)
    if context is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


def _selective_context(policy: ActivationCheckpointing) -> Any:
    saved = policy.saved_operators()

    def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if getattr(op, "overloadpacket", op) in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, decide)
