"""Reference models that phalanx's strategies, tests and benchmarks train."""

from __future__ import annotations

from phalanx.models.gpt import GPT, Block, GPTConfig, gpt_as_sequential

__all__ = ["GPT", "Block", "GPTConfig", "gpt_as_sequential"]
