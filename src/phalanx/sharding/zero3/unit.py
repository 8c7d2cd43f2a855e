"""One ZeRO-3 unit: its parameters flattened into one padded buffer, of which each rank keeps 1/N.

Layout (as torch FSDP1's ``FlatParameter``): the unit's parameters, in registration order, are
laid end to end in a flat tensor padded to a multiple of the world size N; rank r keeps chunk r
as :attr:`FlatUnit.flat_param`, the ``nn.Parameter`` the optimizer sees. To run, the unit
all-gathers the chunks into :attr:`FlatUnit._buffer` and hands each module a *view* of it in
place of the original parameter. Freeing resizes the buffer's storage to zero, so the views
(and the tensors autograd saved from them) stay valid objects and see the data again after the
next all-gather into the same storage (FSDP2's trick).

Autograd: each step the views are cut with one ``torch.split`` from a fresh leaf that aliases
the buffer (``buffer.data``: same storage, its own version counter, so re-gathering in backward
does not trip autograd's in-place checks). ``split``'s backward concatenates every view's
gradient into one flat gradient for the leaf, whose post-accumulate-grad hook then
reduce-scatters it: no per-parameter copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import collectives as c
from phalanx.sharding.pieces import Piece, pieces_in_range
from phalanx.sharding.zero3.plan import ParamRef, padded_size

__all__ = ["Entry", "FlatUnit", "GroupInfo", "PendingReduce"]

FREE, GATHERING, GATHERED = "free", "gathering", "gathered"


@dataclass(frozen=True)
class GroupInfo:
    """The data-parallel group as a unit needs it."""

    group: dist.ProcessGroup | None
    """The ranks the unit is sharded over."""
    rank: int
    world: int
    src: int
    """Global rank of the group's rank 0 (the source of ``sync_module_states``)."""
    replicate: dist.ProcessGroup | None = None
    """Hybrid sharding: the ranks that hold the same shard on other hosts (None: none)."""
    replicas: int = 1
    """Size of :attr:`replicate` (1 without it)."""
    replica: int = 0
    """This rank's index in :attr:`replicate` (only replica 0 writes checkpoint pieces)."""
    replica_src: int = 0
    """Global rank of :attr:`replicate`'s rank 0."""

    @property
    def ranks(self) -> int:
        """Every rank the gradient is averaged over: ``world * replicas``."""
        return self.world * self.replicas


@dataclass
class Entry:
    """One original parameter inside a unit's flat tensor."""

    keys: list[str]
    slots: list[tuple[nn.Module, str]]
    shape: tuple[int, ...]
    numel: int
    offset: int


@dataclass
class PendingReduce:
    """An issued reduce-scatter whose result becomes ``unit.flat_param.grad`` on :meth:`finish`.

    Under hybrid sharding the reduced shard is then all-reduced over the replicate group
    (:meth:`cross`), which the runtime starts before it waits for it, so the traffic between
    hosts overlaps the next unit's backward.
    """

    unit: FlatUnit
    work: Any
    out: torch.Tensor
    source: torch.Tensor | None  # the full gradient: kept alive until the collective completes
    divide: bool
    across: Any = None
    """The all-reduce over the replicate group, once :meth:`cross` started it."""

    @property
    def crosses(self) -> bool:
        """Whether the shard still goes to the other hosts (hybrid sharding)."""
        return self.unit.info.replicate is not None

    def cross(self) -> None:
        """Wait for the reduce-scatter (the full gradient goes), then start the all-reduce of
        the shard over the replicate group, if any. Once; :meth:`finish` calls it if needed."""
        if self.source is None:
            return
        if self.work is not None:
            self.work.wait()
        self.work = self.source = None
        info = self.unit.info
        if info.replicate is not None:
            self.across = c.all_reduce(self.out, group=info.replicate, async_op=True)

    def finish(self) -> None:
        self.cross()
        if self.across is not None:
            self.across.wait()
        if self.divide:
            self.out.div_(self.unit.info.ranks)
        self.unit.accumulate_shard_grad(self.out)


class FlatUnit:
    """A sharded group of parameters with its all-gather / free / reduce-scatter steps.

    Args:
        name: Module path of the unit (``""`` for the root unit).
        module: The module whose forward uses these parameters.
        refs: The parameters (with every place they are registered).
        info: The process group.
        compute_dtype: dtype parameters are gathered and computed in (None: their own).
        reduce_dtype: dtype gradients are reduce-scattered in (None: the compute dtype).
        sync_states: Broadcast rank 0's values before sharding.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        refs: list[ParamRef],
        info: GroupInfo,
        compute_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        sync_states: bool,
    ) -> None:
        self.name, self.module, self.info = name, module, info
        first = refs[0].param
        self.dtype, self.device, self.requires_grad = first.dtype, first.device, first.requires_grad
        _check_uniform(name, refs, info.rank)
        self.compute_dtype = compute_dtype or self.dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.entries: list[Entry] = []
        offset = 0
        for ref in refs:
            n = ref.param.numel()
            self.entries.append(Entry(ref.keys, ref.slots, tuple(ref.param.shape), n, offset))
            offset += n
        self.total = offset
        self._split(info)
        self.flat_param = nn.Parameter(self._initial_shard(sync_states), first.requires_grad)
        self._fresh_buffer()

    def _split(self, info: GroupInfo) -> None:
        """Shard sizes and this rank's pieces for the group ``info``."""
        self.info = info
        self.padded = padded_size(self.total, info.world)
        self.chunk = self.padded // info.world
        pad = self.padded - self.total
        self.split_sizes = [e.numel for e in self.entries] + ([pad] if pad else [])
        lo = info.rank * self.chunk
        self.pieces: list[Piece] = pieces_in_range(
            [(e.keys[0], e.shape, e.offset) for e in self.entries], lo, lo + self.chunk
        )
        """The parts of the original parameters this rank's shard holds (offsets in it)."""

    def _fresh_buffer(self) -> None:
        """A freed gather buffer, the views on it, no gradient in flight."""
        self._buffer = torch.empty(self.padded, dtype=self.compute_dtype, device=self.device)
        self.state = GATHERED
        self._work: Any = None
        self._source: torch.Tensor | None = None
        self.make_views(None)  # so the attributes exist before the first forward
        self.free()
        self._full: torch.Tensor | None = None
        self._grad_accum: torch.Tensor | None = None
        self.reduced = False

    @torch.no_grad()
    def reshard(self, info: GroupInfo) -> None:
        """Shard over the group ``info`` from now on: ``flat_param`` stays the same object, its
        data becomes a zeroed shard of the new size (fill it with ``load_full_state_dict``),
        its gradient and any gathered or accumulated full tensor are dropped."""
        self._split(info)
        self.flat_param.grad = None
        self.flat_param.data = torch.zeros(self.chunk, dtype=self.dtype, device=self.device)
        self._fresh_buffer()

    def _initial_shard(self, sync_states: bool) -> torch.Tensor:
        with torch.no_grad():
            full = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
            for e in self.entries:
                full[e.offset : e.offset + e.numel].copy_(self._original(e).reshape(-1))
                for mod, pname in e.slots:
                    del mod._parameters[pname]
            if sync_states and self.info.world > 1:
                c.broadcast(full, self.info.src, self.info.group)
            if sync_states and self.info.replicas > 1:  # host by host, then across hosts
                c.broadcast(full, self.info.replica_src, self.info.replicate)
            r = self.info.rank
            return full[r * self.chunk : (r + 1) * self.chunk].clone()

    @staticmethod
    def _original(e: Entry) -> torch.Tensor:
        mod, pname = e.slots[0]
        p = mod._parameters[pname]
        assert p is not None
        return p.detach()

    # ---- all-gather / free ------------------------------------------------------------------
    @torch.no_grad()
    def gather(self, async_op: bool) -> None:
        """Start (or run) the all-gather of the full flat tensor into the buffer."""
        assert self.state == FREE, f"unit {self.name!r}: gather while {self.state}"
        storage = self._buffer.untyped_storage()
        storage.resize_(self.padded * self._buffer.element_size())
        src = self.flat_param.detach()
        if src.dtype != self.compute_dtype:
            src = src.to(self.compute_dtype)  # mixed precision: the wire carries param_dtype
        self._source = src
        self._work = c.all_gather_into_tensor(
            self._buffer, src, group=self.info.group, async_op=async_op
        )
        self.state = GATHERING if async_op else GATHERED
        if not async_op:
            self._work = self._source = None

    def ensure_gathered(self) -> None:
        """Make the full parameters available (wait for a prefetch, or gather now)."""
        if self.state == FREE:
            self.gather(async_op=False)
        elif self.state == GATHERING:
            self._work.wait()
            self._work = self._source = None
            self.state = GATHERED

    def free(self) -> None:
        """Release the full parameters' memory (views stay, pointing at an empty storage)."""
        if self.state == GATHERING:
            self.ensure_gathered()
        self._buffer.untyped_storage().resize_(0)
        self.state = FREE

    def gathered_bytes(self) -> int:
        """Bytes of full-parameter storage currently allocated."""
        return int(self._buffer.untyped_storage().nbytes())

    # ---- views ------------------------------------------------------------------------------
    def make_views(self, on_grad: Callable[[FlatUnit, torch.Tensor], None] | None) -> None:
        """Point every original attribute at a view of the gathered buffer.

        With ``on_grad`` (grad mode and trainable), the views come from a fresh leaf whose
        post-accumulate-grad hook calls ``on_grad(self, leaf)`` once the unit's gradient is
        complete.
        """
        full = self._buffer.data  # aliases the storage, own version counter
        if on_grad is not None:
            full.requires_grad_(True)
            full.register_post_accumulate_grad_hook(lambda leaf: on_grad(self, leaf))
        self._full = full
        for e, piece in zip(self.entries, torch.split(full, self.split_sizes)):
            view = piece.view(e.shape)
            for mod, pname in e.slots:
                mod.__dict__[pname] = view  # a plain attribute: found before Module.__getattr__

    @property
    def has_views(self) -> bool:
        """Whether this step's views exist already."""
        return self._full is not None

    def drop_views(self) -> None:
        """Forget this step's autograd leaf (the next forward makes a new one)."""
        self._full = None

    # ---- gradients --------------------------------------------------------------------------
    def reduce_grad(self, grad: torch.Tensor, sync: bool) -> PendingReduce | None:
        """Reduce-scatter the full gradient (or, under ``no_sync``, accumulate it locally)."""
        if not sync:
            if self._grad_accum is None:
                self._grad_accum = grad.to(self.dtype)  # owned: the engine's fresh tensor
            else:
                self._grad_accum.add_(grad)
            return None
        if self._grad_accum is not None:
            grad, self._grad_accum = self._grad_accum.add_(grad), None
        grad = grad.to(self.reduce_dtype)
        predivide = self.reduce_dtype == torch.float16  # keep fp16 sums in range
        if predivide:
            grad.div_(self.info.ranks)
        out = torch.empty(self.chunk, dtype=self.reduce_dtype, device=self.device)
        work = c.reduce_scatter_tensor(out, grad, group=self.info.group, async_op=True)
        self.reduced = True
        return PendingReduce(self, work, out, grad, not predivide)

    def zero_grad_for_reduce(self) -> torch.Tensor:
        """A zero full gradient (units that got none still join the collective)."""
        return torch.zeros(self.padded, dtype=self.reduce_dtype, device=self.device)

    def accumulate_shard_grad(self, shard: torch.Tensor) -> None:
        """Add a reduced shard gradient to ``flat_param.grad``."""
        shard = shard.to(self.dtype)
        if self.flat_param.grad is None:
            self.flat_param.grad = shard
        else:
            self.flat_param.grad.add_(shard)

    def accumulated_bytes(self) -> int:
        """Bytes of the unsharded gradient held under ``no_sync``."""
        acc = self._grad_accum
        return 0 if acc is None else acc.numel() * acc.element_size()

    def __repr__(self) -> str:
        return (
            f"FlatUnit({self.name or '<root>'!r}, params={len(self.entries)}, "
            f"numel={self.total}, shard={self.chunk})"
        )


def _check_uniform(name: str, refs: list[ParamRef], rank: int) -> None:
    first = refs[0].param
    for ref in refs:
        p = ref.param
        if (p.dtype, p.device) != (first.dtype, first.device):
            raise ValueError(
                f"[rank {rank}] FullyShardedDataParallel: unit {name or '<root>'!r} mixes "
                f"{ref.keys[0]} ({p.dtype}, {p.device}) with {refs[0].keys[0]} "
                f"({first.dtype}, {first.device}); wrap them into separate units"
            )
        if p.requires_grad != first.requires_grad:
            raise ValueError(
                f"[rank {rank}] FullyShardedDataParallel: unit {name or '<root>'!r} mixes "
                f"frozen and trainable parameters ({ref.keys[0]}.requires_grad="
                f"{p.requires_grad}, {refs[0].keys[0]}.requires_grad={first.requires_grad}); "
                f"wrap them into separate units"
            )
