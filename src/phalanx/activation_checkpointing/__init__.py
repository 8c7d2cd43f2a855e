"""Activation checkpointing: recompute a model's block activations in backward to save memory.

``phalanx.Job(activation_checkpointing="full")`` applies it under any strategy;
:func:`checkpoint_activations` applies it to any model (``policy.py`` says which blocks and
operators, ``apply.py`` how; docs/activation-checkpointing.md).
"""

from phalanx.activation_checkpointing.apply import checkpoint_activations, checkpointed_blocks
from phalanx.activation_checkpointing.policy import ActivationCheckpointing

__all__ = ["ActivationCheckpointing", "checkpoint_activations", "checkpointed_blocks"]
