"""Reference models that phalanx's strategies, tests and benchmarks train."""

from __future__ import annotations

from phalanx.models.gpt import GPT, Block, GPTConfig, gpt_as_sequential
from phalanx.models.resnet import BasicBlock, small_resnet

__all__ = ["GPT", "BasicBlock", "Block", "GPTConfig", "gpt_as_sequential", "small_resnet"]
