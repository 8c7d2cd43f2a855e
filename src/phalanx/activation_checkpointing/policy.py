"""Which blocks recompute their activations, and which results a selective policy keeps.

Activation checkpointing trades compute for memory: a checkpointed block keeps only its inputs
through the forward pass and runs its forward again during backward to rebuild what backward
needs (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"). Three forms, as the
peers offer them (torch's ``checkpoint_wrapper``, torchtitan's full and selective AC,
Megatron's recompute):

- ``mode="full"``: every selected block keeps only its inputs.
- ``every=k``: only every k-th block (the 1st, the (k+1)-th...) is checkpointed; the others keep
  everything. k trades memory against recomputation.
- ``mode="selective"``: inside each selected block, the results of the expensive operators
  (``save``: matrix products and attention by default) are kept and everything else
  (activations, norms, softmax, dropout) is recomputed: most of full AC's saving on the
  element-wise tensors at a fraction of its recomputation.

The blocks are the repeated submodules of the model: by default the class of which the model
holds at least two instances that contain other modules, taking the class whose instances hold
the most parameters, outermost instances only (a GPT's transformer blocks, a ResNet's residual
blocks). ``blocks=`` names them otherwise: a class, a tuple of classes or a predicate
``(qualified_name, module) -> bool``.

This module only plans (no tensor is touched); :mod:`phalanx.activation_checkpointing.apply`
installs the recomputation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from phalanx._check import check_choice, check_int, fail, shown

__all__ = ["DEFAULT_SAVE", "ActivationCheckpointing", "BlockSpec", "select_blocks", "to_policy"]

BlockSpec = type | tuple[type, ...] | Callable[[str, nn.Module], bool] | None
"""``blocks=``: a module class, a tuple of classes, a predicate ``(name, module) -> bool``, or
None (the model's repeated blocks, found as the module docstring says)."""

DEFAULT_SAVE = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
"""The ``aten`` operators whose results ``mode="selective"`` keeps by default: the matrix
products and attention kernels, whose recomputation costs the most per byte kept."""

WHERE = "ActivationCheckpointing"


@dataclass(frozen=True)
class ActivationCheckpointing:
    """Recompute the activations of a model's blocks in backward instead of keeping them.

    ``phalanx.Job(activation_checkpointing="full")`` (or ``"selective"``, or an instance of this
    class) applies it to the model handed to ``job.setup`` under every strategy;
    :func:`phalanx.checkpoint_activations` applies it to any model.

    Args:
        mode: "full" (a block keeps only its inputs) or "selective" (a block also keeps the
            results of the ``save`` operators and recomputes the rest).
        every: Checkpoint every ``every``-th block (the first, the ``every+1``-th...), leaving
            the others as they are; 1 checkpoints every block.
        blocks: Which modules are blocks (see :data:`BlockSpec`); None finds the model's
            repeated blocks.
        save: With ``mode="selective"``: names of ``aten`` operators ("mm", "addmm", ...) whose
            results are kept; None: :data:`DEFAULT_SAVE`.
    """

    mode: str = "full"
    every: int = 1
    blocks: BlockSpec = None
    save: tuple[str, ...] | None = None

    modes: ClassVar[tuple[str, ...]] = ("full", "selective")

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, self.modes, where=WHERE)
        check_int("every", self.every, min=1, where=WHERE)
        _check_blocks(self.blocks)
        if self.save is not None:
            if self.mode != "selective":
                raise fail(
                    "save",
                    self.save,
                    "None unless mode='selective'",
                    where=WHERE,
                    fix="full checkpointing keeps no operator's result",
                )
            object.__setattr__(self, "save", tuple(self.save))
            for name in self.save:
                operator_of(name)

    def saved_operators(self) -> frozenset[Any]:
        """The operator packets (``torch.ops.aten.mm``...) whose results a selective block keeps."""
        names = DEFAULT_SAVE if self.save is None else self.save
        found = (_lookup(name) for name in names)
        return frozenset(op for op in found if op is not None)


def _check_blocks(blocks: object) -> None:
    if blocks is None or (callable(blocks) and not isinstance(blocks, type)):
        return
    classes = blocks if isinstance(blocks, tuple) else (blocks,)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise fail(
            "blocks",
            blocks,
            "an nn.Module class, a tuple of them, a predicate (name, module) -> bool or None",
            where=WHERE,
            error=TypeError,
        )


def _lookup(name: str) -> Any:
    namespace, _, op = name.rpartition(".")
    return getattr(getattr(torch.ops, namespace or "aten"), op, None)


def operator_of(name: object) -> Any:
    """The operator packet ``name`` denotes ("mm" is ``torch.ops.aten.mm``; "ns.op" another
    namespace's); ``ValueError`` naming it when torch has no such operator."""
    if not isinstance(name, str) or not name:
        raise fail("save", name, "a tuple of operator names such as 'mm'", where=WHERE)
    op = _lookup(name)
    if op is None:
        raise fail(
            "save",
            name,
            "names of torch operators",
            where=WHERE,
            fix=f"torch.ops.aten has no {name!r} (e.g. 'mm', 'addmm', 'bmm', 'convolution')",
        )
    return op


def to_policy(value: object, where: str = "Job") -> ActivationCheckpointing | None:
    """``activation_checkpointing=`` as an :class:`ActivationCheckpointing`: None, "full",
    "selective" or an instance (returned as is)."""
    if value is None or isinstance(value, ActivationCheckpointing):
        return value
    if isinstance(value, str) and value in ActivationCheckpointing.modes:
        return ActivationCheckpointing(mode=value)
    raise fail(
        "activation_checkpointing",
        value,
        "None, 'full', 'selective' or a phalanx.ActivationCheckpointing(...)",
        where=where,
        error=ValueError if isinstance(value, str) else TypeError,
    )


def select_blocks(model: nn.Module, policy: ActivationCheckpointing) -> list[tuple[str, nn.Module]]:
    """The ``(qualified name, module)`` of each block ``policy`` checkpoints, in model order.

    Outermost matches only (a block inside a block is not a block of its own), then every
    ``policy.every``-th of them.

    Raises:
        ValueError: No module of ``model`` is a block, naming the model's class and the fix.
    """
    matches = _matcher(model, policy.blocks)
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(outer + ".") for outer, _ in found):
            continue
        if matches(name, module):
            found.append((name, module))
    if not found:
        what = (
            "repeated blocks"
            if policy.blocks is None
            else f"modules matching {shown(policy.blocks)}"
        )
        raise ValueError(
            f"activation_checkpointing: {type(model).__name__} has no {what} to checkpoint; "
            "pass phalanx.ActivationCheckpointing(blocks=YourBlockClass)"
        )
    return found[:: policy.every]


def _matcher(model: nn.Module, blocks: BlockSpec) -> Callable[[str, nn.Module], bool]:
    if blocks is None:
        block_class = repeated_block_class(model)
        return lambda _name, module: type(module) is block_class
    if isinstance(blocks, type | tuple):
        classes = blocks
        return lambda _name, module: isinstance(module, classes)
    return blocks


def repeated_block_class(model: nn.Module) -> type | None:
    """The class of the model's repeated blocks: of the classes with at least two instances
    that contain other modules, the one whose instances hold the most parameters (None when
    there is none)."""
    params: dict[type, int] = {}
    count: dict[type, int] = {}
    for module in model.modules():
        if module is model or next(module.children(), None) is None:
            continue
        cls = type(module)
        count[cls] = count.get(cls, 0) + 1
        params[cls] = params.get(cls, 0) + sum(p.numel() for p in module.parameters())
    candidates = [cls for cls, n in count.items() if n >= 2]
    return max(candidates, key=lambda cls: params[cls], default=None)
