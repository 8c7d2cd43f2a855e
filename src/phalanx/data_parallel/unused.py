"""Parameters that received no gradient in a backward pass that was to reduce them."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["UnusedParameterError"]


class UnusedParameterError(RuntimeError):
    """Some parameters received no gradient while ``find_unused_parameters=False``."""

    @classmethod
    def naming(cls, names: list[str]) -> UnusedParameterError:
        """The error for these parameters, with the three ways out."""
        shown = ", ".join(repr(n) for n in names[:20])
        more = f" and {len(names) - 20} more" if len(names) > 20 else ""
        return cls(
            f"[rank {dist.get_rank()}] DistributedDataParallel: {len(names)} parameter(s) "
            f"received no gradient in this backward pass: {shown}{more}. Either make them take "
            f"part in computing the loss, set requires_grad=False on them, or pass "
            f"find_unused_parameters=True to DistributedDataParallel."
        )
