"""The small GPT with dropout that the exact-resume tests train, its loss and its digest (used by
``test_job_resume_every_step.py`` and ``test_loop_shapes.py``)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.nn import functional as F

from phalanx.models import GPT, GPTConfig

VOCAB, BLOCK = 32, 8


def small_gpt() -> GPT:
    """One layer, two heads, width 16, dropout 0.2: a resume that restores the generators at
    another moment draws other masks and differs."""
    return GPT(GPTConfig(VOCAB, BLOCK, 1, 2, 16, dropout=0.2))


def lm_loss(output: tuple[torch.Tensor, Any], targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of the GPT's ``(logits, ...)`` output."""
    return F.cross_entropy(output[0].flatten(0, 1), targets.flatten())


def params_digest(model: torch.nn.Module) -> str:
    """sha256 of the parameters' bytes, in order."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()
