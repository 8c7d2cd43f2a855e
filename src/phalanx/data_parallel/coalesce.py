"""Coalescing: many tensors as one flat tensor per (device, dtype), and back.

One collective on a flat buffer costs one latency instead of one per tensor; a flat buffer
holds one dtype on one device, so tensors are grouped by kind first (first-seen order, so every
rank groups the same tensors the same way).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

__all__ = ["copy_back", "flatten", "group_by_kind", "kind", "unflatten"]


def kind(t: torch.Tensor) -> tuple[torch.device, torch.dtype]:
    """The key tensors that may share a flat buffer have in common."""
    return t.device, t.dtype


def group_by_kind(
    tensors: Sequence[torch.Tensor],
    key: Callable[[torch.Tensor], Hashable] = kind,
) -> list[list[int]]:
    """Indices of ``tensors`` grouped by ``key`` (device and dtype by default), each group in
    the tensors' order, groups in the order of their first member."""
    groups: dict[Hashable, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(key(t), []).append(i)
    return list(groups.values())


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One new 1-D tensor holding ``tensors`` one after the other (cast to ``dtype`` if given).

    Raises:
        ValueError: ``tensors`` is empty (there is no device or dtype to give the result).
    """
    if not tensors:
        raise ValueError("flatten: tensors must not be empty")
    return torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``like``, in order (the inverse of :func:`flatten`).

    Raises:
        ValueError: ``flat`` does not hold exactly the elements of ``like``.
    """
    sizes = [t.numel() for t in like]
    if flat.numel() != sum(sizes):
        raise ValueError(
            f"unflatten: flat has {flat.numel()} elements, the tensors {sum(sizes)} ({sizes})"
        )
    return [piece.view(t.shape) for piece, t in zip(flat.split(sizes), like)]


def copy_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy the pieces of ``flat`` into ``tensors`` (cast to each one's dtype)."""
    with torch.no_grad():
        for t, piece in zip(tensors, unflatten(flat, tensors)):
            t.copy_(piece)
