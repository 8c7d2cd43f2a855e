"""Pure shard plan for a parameter server: which server owns which parameter, and where.

Each parameter lives whole on one server (parameters are not split, so a server can apply its
optimizer per parameter without gathering). Assignment is the classic LPT heuristic (Graham 1969,
"Bounds on multiprocessing timing anomalies"): take parameters largest first and give each to the
least-loaded server so far. Its makespan is within 4/3 of optimal, and it is deterministic here:
equal sizes are ordered by name, equal loads by fewer parameters then lower server index. The
largest shard bounds the server-side time of one round, so balancing elements balances it.

A server's shard is one flat vector: its parameters in the caller's order, back to back. One
PUSH or PARAMS message then carries the whole shard as a single contiguous tensor.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["ParamSlot", "ShardPlan", "plan_shards"]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives: its server and its range in that server's flat shard."""

    name: str
    """Parameter name (as in ``model.named_parameters()``)."""
    server: int
    """Index of the owning server, ``0 <= server < num_servers``."""
    offset: int
    """First element of the parameter in the server's flat shard."""
    numel: int
    """Number of elements."""


@dataclass(frozen=True)
class ShardPlan:
    """Every parameter's owner and flat offset; one tuple of slots per server."""

    servers: tuple[tuple[ParamSlot, ...], ...]
    """``servers[s]``: the slots of server ``s`` in flat-layout order."""

    @property
    def num_servers(self) -> int:
        """Number of servers."""
        return len(self.servers)

    def numel(self, server: int) -> int:
        """Elements in ``server``'s flat shard."""
        return sum(s.numel for s in self.slots(server))

    def loads(self) -> tuple[int, ...]:
        """Elements per server, by server index."""
        return tuple(self.numel(s) for s in range(self.num_servers))

    def slots(self, server: int) -> tuple[ParamSlot, ...]:
        """The slots of ``server``, in flat-layout order."""
        if not 0 <= server < self.num_servers:
            raise ValueError(
                f"server must be in [0, {self.num_servers}), got {server} "
                f"(the plan has {self.num_servers} servers)"
            )
        return self.servers[server]

    def server_of(self, name: str) -> int:
        """Index of the server that owns parameter ``name``."""
        for slots in self.servers:
            for slot in slots:
                if slot.name == name:
                    return slot.server
        raise KeyError(f"parameter {name!r} is not in the shard plan")

    def flatten(self, tensors: Mapping[str, torch.Tensor], server: int) -> torch.Tensor:
        """Concatenate ``server``'s tensors (e.g. gradients by name) into its flat shard.

        Tensors of other servers in ``tensors`` are ignored. All of this server's tensors must
        share one dtype and device; the result is a new contiguous 1-D tensor.

        Raises:
            ValueError: naming the server and the missing parameters, or the parameter whose
                element count differs from the plan.
        """
        slots = self.slots(server)
        missing = [s.name for s in slots if s.name not in tensors]
        if missing:
            raise ValueError(f"flatten: server {server} needs {missing}, missing from tensors")
        for s in slots:
            if tensors[s.name].numel() != s.numel:
                raise ValueError(
                    f"flatten: {s.name!r} has {tensors[s.name].numel()} elements, the plan "
                    f"says {s.numel} (server {server})"
                )
        return torch.cat([tensors[s.name].reshape(-1) for s in slots])

    def unflatten(
        self,
        flat: torch.Tensor,
        server: int,
        shapes: Mapping[str, Sequence[int]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Split ``server``'s flat shard into per-parameter views (no copies).

        The plan knows element counts only, so the views are 1-D unless ``shapes`` gives a
        parameter's shape. Writing into a view writes into ``flat``.

        Raises:
            ValueError: when ``flat`` is not 1-D or its length is not the shard's.
        """
        total = self.numel(server)
        if flat.dim() != 1 or flat.numel() != total:
            raise ValueError(
                f"unflatten: server {server}'s shard is 1-D with {total} elements, "
                f"got shape {tuple(flat.shape)}"
            )
        views = {}
        for s in self.slots(server):
            view = flat.narrow(0, s.offset, s.numel)
            views[s.name] = (
                view.view(tuple(shapes[s.name])) if shapes and s.name in shapes else view
            )
        return views


def _check(param_sizes: Sequence[tuple[str, int]], num_servers: int) -> None:
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    if num_servers > len(param_sizes):
        raise ValueError(
            f"num_servers={num_servers} is more than the {len(param_sizes)} parameters in "
            f"param_sizes: a server would own nothing; use at most {len(param_sizes)} servers"
        )
    seen: set[str] = set()
    for name, size in param_sizes:
        if name in seen:
            raise ValueError(f"param_sizes names {name!r} twice")
        if size < 0:
            raise ValueError(f"param_sizes: {name!r} has a negative size {size}")
        seen.add(name)


def plan_shards(param_sizes: Sequence[tuple[str, int]], num_servers: int) -> ShardPlan:
    """Assign whole parameters to servers, balancing elements (largest first, least loaded).

    Args:
        param_sizes: ``(name, numel)`` per parameter, in model order; names unique.
        num_servers: Number of parameter servers, ``1 <= num_servers <= len(param_sizes)``.

    Returns:
        The plan; each server's flat layout keeps the order of ``param_sizes``.

    Raises:
        ValueError: for ``num_servers < 1``, more servers than parameters (naming both),
            a repeated name or a negative size.
    """
    _check(param_sizes, num_servers)
    # heap entries (load, count, server): ties go to the server with fewer parameters, then
    # the lower index, so that zero-sized parameters still leave no server empty.
    heap = [(0, 0, s) for s in range(num_servers)]
    owner: dict[str, int] = {}
    for name, size in sorted(param_sizes, key=lambda p: (-p[1], p[0])):
        load, count, server = heapq.heappop(heap)
        owner[name] = server
        heapq.heappush(heap, (load + size, count + 1, server))
    layout: list[list[ParamSlot]] = [[] for _ in range(num_servers)]
    offsets = [0] * num_servers
    for name, size in param_sizes:
        s = owner[name]
        layout[s].append(ParamSlot(name, s, offsets[s], size))
        offsets[s] += size
    return ShardPlan(tuple(tuple(slots) for slots in layout))
