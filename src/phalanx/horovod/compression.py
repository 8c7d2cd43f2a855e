"""Horovod's gradient compression interface: ``Compression.none`` and ``Compression.fp16``.

A compressor is a class with ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``; the compressed tensor is what travels in the all-reduce.
User-written compressors with the same two methods work wherever these do.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor(abc.ABC):
    """Interface: compress a tensor for the wire, decompress what came back."""

    @staticmethod
    @abc.abstractmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and the context :meth:`decompress` needs."""

    @staticmethod
    @abc.abstractmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Undo :meth:`compress` on the reduced tensor."""


class NoneCompressor(Compressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return ``tensor`` unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return ``tensor`` unchanged."""
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16 (half the bytes); other dtypes unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Cast a floating-point tensor to float16; the context is the original dtype."""
        if tensor.is_floating_point() and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Cast back to the original dtype."""
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class Compression:
    """The available compressors, under Horovod's names."""

    none = NoneCompressor
    """No compression (the default)."""
    fp16 = FP16Compressor
    """Floating-point tensors travel as float16."""


def check_compression(compression: Any) -> None:
    """Raise a TypeError unless ``compression`` has ``compress`` and ``decompress``."""
    if not (
        callable(getattr(compression, "compress", None))
        and callable(getattr(compression, "decompress", None))
    ):
        raise TypeError(
            f"compression={compression!r} must have compress(tensor) and "
            f"decompress(tensor, ctx), e.g. hvd.Compression.none or hvd.Compression.fp16"
        )
