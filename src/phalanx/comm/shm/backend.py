"""``ShmProcessGroup``: the c10d process group behind ``backend="shm"``.

A Python subclass of ``torch.distributed.ProcessGroup`` (``base.ShmGroup``, which takes torch's
call forms and hands this class ``_allreduce`` and the rest): torch's Python collectives call its
methods directly, and C++ callers (DDP's reducer, functional collectives) reach the ones that
torch's ``PyProcessGroup`` trampoline forwards (allreduce, broadcast, allgather, barrier,
all_gather_single, reduce_scatter(_single), all_to_all_single). Those run on shared memory.
Everything else (send/recv, gather, scatter, list all_to_all, coalesced calls) is not defined
here, so it falls through to the C++ base class, which dispatches to the gloo backend that
the group registers for the CPU device, made over the same store under its own prefix.

all_reduce, reduce_scatter_tensor and all_gather_into_tensor of tensors that every rank keeps
in one of the group's shared buffers (``shared_buffer``) take the zero-copy path
(``zero_copy.py``); ``zero_copy_calls`` counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm.call_sites import UNKNOWN, site_of_caller
from phalanx.comm.flags import sites_compared
from phalanx.comm.shm import collectives, zero_copy
from phalanx.comm.shm.base import ShmGroup
from phalanx.comm.shm.buffers import Regions
from phalanx.comm.shm.channel import Channel, guarded
from phalanx.comm.shm.descriptor import Call
from phalanx.comm.shm.futex import available
from phalanx.comm.shm.layout import Layout
from phalanx.comm.shm.ops import check_dtype, check_reduction, op_code
from phalanx.comm.shm.segment import SEGMENT_KEY, Meeting, check_one_host, open_segment, signer
from phalanx.comm.shm.settings import slot_bytes_from_env, spin_seconds_from_env
from phalanx.comm.shm.sync import Arrivals
from phalanx.comm.shm.worker import Executor, ShmWork

__all__ = ["ShmProcessGroup", "flat_cpu"]

_GLOO_PREFIX = "phalanx_shm_gloo/"
_MAX_CALLS = 256


def flat_cpu(t: torch.Tensor, name: str, where: str) -> torch.Tensor:
    """``t`` as a flat view outside autograd, refusing what the shm backend cannot take
    (naming ``where``). Detached: a collective writes the data of a tensor that requires grad
    (DDP's buckets under ``backward(create_graph=True)``) as gloo does, without autograd."""
    if not t.is_cpu:
        raise ValueError(f"{where}: backend 'shm' takes CPU tensors, {name} is on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{where}: {name} must be contiguous (call .contiguous() first)")
    t = t.detach()
    return t if t.dim() == 1 else t.view(-1)


def _one(tensors: Sequence[torch.Tensor], where: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{where}: backend 'shm' takes one tensor per call, got {len(tensors)}")
    return tensors[0]


class ShmProcessGroup(ShmGroup):
    """A process group whose collectives go through one shared-memory segment."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: timedelta,
        met: Meeting | None = None,
    ):
        """``met``: where the ranks run, when the caller met them already (else met here)."""
        super().__init__(rank, world_size)
        reason = available()
        if reason is not None:
            raise RuntimeError(f"backend='shm' cannot run on {reason}; use backend='gloo'")
        layout, spin = Layout(world_size, slot_bytes_from_env()), spin_seconds_from_env()
        met = met or check_one_host(store, rank, world_size, timeout)
        signed = signer(store)
        path, segment = open_segment(signed.sub(SEGMENT_KEY), met, layout.total_bytes, timeout)
        self.segment_path = path
        """Where the group's segment was in /dev/shm (unlinked once every rank mapped it)."""
        arrivals = Arrivals(segment, layout, rank, timeout.total_seconds(), spin, met.processes)
        label = f"shm group of {world_size} (rank {rank})"
        self._channel = Channel(segment, layout, arrivals, label)
        gloo_store = dist.PrefixStore(_GLOO_PREFIX, store)
        self._gloo = dist.ProcessGroupGloo(gloo_store, rank, world_size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._executor = Executor(f"phalanx-shm-rank{rank}")
        self._named = False
        self._regions = Regions(signed, met, timeout)
        self.zero_copy_calls = 0
        """Collectives that ran on shared buffers, reading the peers' tensors in place."""
        self._calls: dict[tuple[str, torch.dtype, int, int, int], Call] = {}
        self._sites = sites_compared()
        """Compare the lines that issue calls (``PHALANX_CALL_SITES``; ``descriptor.py``)."""

    def shutdown(self) -> None:
        """Finish the queued calls, unmap the segment, shut the gloo group underneath down."""
        self._executor.stop()
        self._channel.close()
        self._regions.close()
        self._gloo.shutdown()

    def fail(self, error: BaseException) -> None:
        """Mark the group broken by ``error`` (raised outside it, e.g. by a hierarchical group's
        call between machines), so that peers waiting in its calls give up now, not at the
        timeout."""
        self._channel.broken = error
        self._channel.arrivals.fail()

    def shared_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled 1-D tensor in the group's shared memory (collective: every rank calls
        it alike); collectives on tensors inside such buffers on every rank copy nothing."""
        return self._regions.allocate(numel, dtype)

    def _zero_copy(self, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            body()
            self.zero_copy_calls += 1

        return run

    # -- the collectives ------------------------------------------------------------------
    def _submit(self, call: Call, body: Callable[[], None], value: object, opts: Any) -> ShmWork:
        channel = self._channel
        if not self._named:
            channel.label = f"shm group {self.group_name!r} (rank {self._rank})"
            self._named = True

        timeout = getattr(opts, "timeout", None)  # torch's "unset" is negative
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        site = site_of_caller() if self._sites else UNKNOWN  # on the issuing thread

        def run() -> None:
            channel.begin(call, seconds if seconds > 0 else None, site)
            guarded(channel, body)

        return self._executor.submit(run, value, wake=bool(getattr(opts, "asyncOp", True)))

    def _call(self, kind: str, dtype: torch.dtype, numel: int, op: int = 0, root: int = 0) -> Call:
        """The descriptor of a call on plain tensors, made once per shape (a training step
        repeats a few, and making one costs microseconds)."""
        key = (kind, dtype, numel, op, root)
        call = self._calls.get(key)
        if call is None:
            if len(self._calls) >= _MAX_CALLS:
                self._calls.clear()
            call = self._calls[key] = Call(kind, dtype, numel, op, root)
        return call

    def _check_root(self, root: int, where: str) -> int:
        if not 0 <= root < self._size:
            raise ValueError(f"{where}: root rank {root} is outside 0..{self._size - 1}")
        return root

    def _allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        one_dense = len(tensors) == 1 and tensors[0].layout == torch.strided
        if not one_dense and any(t.layout != torch.strided for t in tensors):  # sparse: gloo's
            return self._gloo.allreduce(tensors, opts)  # type: ignore[attr-defined]
        flat = flat_cpu(_one(tensors, "all_reduce"), "tensor", "all_reduce")
        code = op_code(opts.reduceOp)
        check_reduction(code, flat.dtype, "all_reduce")
        region, offset = self._regions.locate(flat)
        if region:
            call = Call("all_reduce", flat.dtype, flat.numel(), code, region=region, offset=offset)
        else:
            call = self._call("all_reduce", flat.dtype, flat.numel(), code)
        ch, regions = self._channel, self._regions
        body = lambda: collectives.all_reduce(ch, flat, code)  # noqa: E731
        if region:
            body = self._zero_copy(lambda: zero_copy.all_reduce(ch, regions, flat, code))
        return self._submit(call, body, tensors, opts)

    def _reduce(self, tensors: list[torch.Tensor], opts: Any) -> ShmWork:
        flat = flat_cpu(_one(tensors, "reduce"), "tensor", "reduce")
        code, root = op_code(opts.reduceOp), self._check_root(opts.rootRank, "reduce")
        check_reduction(code, flat.dtype, "reduce")
        call = self._call("reduce", flat.dtype, flat.numel(), code, root)
        ch = self._channel
        return self._submit(
            call, lambda: collectives.all_reduce(ch, flat, code, root), tensors, opts
        )

    def _broadcast(self, tensors: list[torch.Tensor], opts: Any) -> ShmWork:
        flat = flat_cpu(_one(tensors, "broadcast"), "tensor", "broadcast")
        check_dtype(flat.dtype, "broadcast")
        root = self._check_root(opts.rootRank, "broadcast")
        call = self._call("broadcast", flat.dtype, flat.numel(), 0, root)
        ch = self._channel
        return self._submit(call, lambda: collectives.broadcast(ch, flat, root), tensors, opts)

    def _barrier(self, opts: Any) -> ShmWork:
        ch = self._channel
        return self._submit(Call("barrier"), lambda: collectives.barrier(ch), [], opts)

    def _gather_into(
        self, outs: Sequence[torch.Tensor], inp: torch.Tensor, value: object, opts: Any
    ) -> ShmWork:
        flat = flat_cpu(inp, "input", "all_gather")
        check_dtype(flat.dtype, "all_gather")
        if len(outs) != self._size:
            raise ValueError(f"all_gather: {len(outs)} outputs for a group of {self._size}")
        for q, out in enumerate(outs):
            if out.dtype != flat.dtype or out.numel() != flat.numel():
                raise ValueError(
                    f"all_gather: output {q} is {out.dtype} x {out.numel()}, the input "
                    f"{flat.dtype} x {flat.numel()}; they must match"
                )
        flats = [flat_cpu(o, f"output {q}", "all_gather") for q, o in enumerate(outs)]
        region, offset = self._regions.locate(flat)
        call = Call("all_gather", flat.dtype, flat.numel(), region=region, offset=offset)
        ch, regions = self._channel, self._regions
        body = lambda: collectives.all_gather(ch, flats, flat)  # noqa: E731
        if region:
            body = self._zero_copy(lambda: zero_copy.all_gather(ch, regions, flats, flat))
        return self._submit(call, body, value, opts)

    def _allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any
    ) -> ShmWork:
        inp = _one(input_tensors, "all_gather")
        return self._gather_into(output_tensors[0], inp, output_tensors, opts)

    def _all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> ShmWork:
        out = flat_cpu(output, "output", "all_gather_into_tensor")
        if out.numel() != self._size * inp.numel():
            raise ValueError(
                f"all_gather_into_tensor: output has {out.numel()} elements, expected world "
                f"size {self._size} x input {inp.numel()}"
            )
        parts = list(out.split(inp.numel())) if inp.numel() else [out[:0]] * self._size
        return self._gather_into(parts, inp, [output], opts)

    def _reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> ShmWork:
        out = flat_cpu(output, "output", "reduce_scatter_tensor")
        flat = flat_cpu(inp, "input", "reduce_scatter_tensor")
        code = op_code(opts.reduceOp)
        check_reduction(code, flat.dtype, "reduce_scatter_tensor")
        if out.dtype != flat.dtype or flat.numel() != self._size * out.numel():
            raise ValueError(
                f"reduce_scatter_tensor: input is {flat.dtype} x {flat.numel()}, expected "
                f"{out.dtype} x (world size {self._size} x output {out.numel()})"
            )
        region, offset = self._regions.locate(flat)
        call = Call("reduce_scatter", flat.dtype, flat.numel(), code, region=region, offset=offset)
        ch, regions = self._channel, self._regions
        body = lambda: collectives.reduce_scatter(ch, out, flat, code)  # noqa: E731
        if region:
            body = self._zero_copy(lambda: zero_copy.reduce_scatter(ch, regions, out, flat, code))
        return self._submit(call, body, [output], opts)

    def _reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any
    ) -> ShmWork:
        out = _one(output_tensors, "reduce_scatter")
        parts = input_tensors[0]
        if len(parts) != self._size:
            raise ValueError(f"reduce_scatter: {len(parts)} inputs for a group of {self._size}")
        joined = torch.cat([p.detach().reshape(-1) for p in parts]) if parts else out.new_empty(0)
        return self._reduce_scatter_single(out, joined, opts)  # its future: [out], as gloo's

    def _all_to_all_single(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any,
    ) -> ShmWork:
        out = flat_cpu(output, "output", "all_to_all_single")
        flat = flat_cpu(inp, "input", "all_to_all_single")
        check_dtype(flat.dtype, "all_to_all_single")
        if out.dtype != flat.dtype:
            raise ValueError(f"all_to_all_single: output {out.dtype} != input {flat.dtype}")
        sends = self._counts(inp, input_split_sizes, "input_split_sizes")
        recvs = self._counts(output, output_split_sizes, "output_split_sizes")
        call = Call("all_to_all", flat.dtype)
        ch = self._channel
        body = lambda: collectives.all_to_all(ch, out, flat, sends, recvs)  # noqa: E731
        return self._submit(call, body, [output], opts)

    def _counts(self, t: torch.Tensor, splits: Sequence[int], name: str) -> list[int]:
        """Elements per rank from the dim-0 split sizes (equal parts when none are given)."""
        rows = t.size(0) if t.dim() else 1
        per_row = t.numel() // rows if rows else 0
        if not splits:
            if rows % self._size:
                raise ValueError(
                    f"all_to_all_single: dim 0 ({rows}) does not divide by the world size "
                    f"{self._size}; pass {name}"
                )
            return [rows // self._size * per_row] * self._size
        if len(splits) != self._size or sum(splits) != rows or min(splits) < 0:
            raise ValueError(
                f"all_to_all_single: {name}={list(splits)} must be {self._size} sizes >= 0 "
                f"that sum to dim 0 ({rows})"
            )
        return [s * per_row for s in splits]
