"""Streaming DiLoCo's plan: the model cut into fragments, each synchronised on its own beat.

Douillard et al., "Streaming DiLoCo with overlapping communication" (2025): instead of every
parameter every H steps (a burst of the whole model's bytes), fragment ``p`` of ``P`` is
synchronised every H steps at its own offset, so the link carries 1/P of the model at a
time. Fragments are runs of consecutive parameters (consecutive layers, as the paper's
sequential pattern) of about equal element counts; offsets default to ``p·H/P``. Pure
functions, no process group.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["default_offsets", "due", "split_fragments"]


def split_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Indices of ``sizes`` (element counts, in order) cut into ``fragments`` non-empty runs of
    about equal total size.

    Raises:
        ValueError: fewer parameters than fragments, naming both.
    """
    if not 1 <= fragments <= len(sizes):
        raise ValueError(
            f"fragments={fragments} must be between 1 and the number of parameters, "
            f"{len(sizes)}: each fragment holds at least one parameter"
        )
    total, done = sum(sizes), 0
    runs: list[list[int]] = []
    current: list[int] = []
    for i, size in enumerate(sizes):
        current.append(i)
        done += size
        left_params, left_runs = len(sizes) - i - 1, fragments - len(runs) - 1
        # Close the run at its share of the elements, or when every later run needs a parameter.
        if left_runs and (done * fragments >= total * (len(runs) + 1) or left_params == left_runs):
            runs.append(current)
            current = []
    runs.append(current)
    return runs


def default_offsets(every: int, fragments: int) -> list[int]:
    """Fragment ``p``'s offset ``p·every // fragments``: the syncs spread evenly over H."""
    return [p * every // fragments for p in range(fragments)]


def due(step: int, every: int, offset: int) -> bool:
    """Whether a fragment with ``offset`` synchronises after optimizer step ``step`` (1-based):
    at steps ``offset + k·every`` (k >= 1 when the offset is 0)."""
    return step >= max(offset, 1) and (step - offset) % every == 0
