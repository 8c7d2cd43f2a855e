"""``Pipeline``: this rank's stage(s) of a model, trained by running a pipeline schedule.

Each rank of the pipeline ``group`` keeps only its own stage (or, interleaved, its ``chunks``
virtual stages ``c * p + rank``) and runs its action list from :mod:`.schedules`: a forward
receives the previous stage's activations (:mod:`.p2p`), runs the chunk and sends its output
on; a backward receives the output's gradient, backpropagates through the chunk, sends the
input's gradient back, and frees that micro-batch's activations. The last stage computes
``loss_fn(output, target) / micro_batches`` per micro-batch, so the parameter gradients add up
to those of the whole batch under a mean loss (GPipe's synchronous update, Huang et al., 2019).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx._check import (
    FLAG,
    GROUP,
    check_callable,
    check_choice,
    check_instance,
    check_int,
    check_module,
    checked,
    optional,
    part_of,
    rule,
)
from phalanx.comm.collectives import broadcast
from phalanx.comm.shm import GLOO_P2P
from phalanx.pipeline.balance import balance_arg, balance_stages, time_costs
from phalanx.pipeline.p2p import DTYPES, Comm
from phalanx.pipeline.ports import build_ports
from phalanx.pipeline.schedules import SCHEDULES, Action
from phalanx.pipeline.schedules import schedule as make_schedule
from phalanx.pipeline.split_backward import WeightPass, backward_input, backward_weight
from phalanx.pipeline.stage import Chunk, as_tuple, split_batch, split_layers

__all__ = ["Pipeline"]

LOOKAHEAD = 2
"""Actions ahead whose receives are posted before the current one runs (overlap transfers)."""
_Live = dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None and not dist.is_initialized():
        return 1, 0  # a one-stage pipeline in a plain process
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("Pipeline: this process is not a member of the given group")
    return size, rank


def _p2p_mode(group: dist.ProcessGroup | None, p2p: str | None, schedule: str, p: int) -> str:
    backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
    if schedule == "interleaved" and backend not in GLOO_P2P and p > 1:
        # Our interleaved traffic relies on tags (several boundaries share a rank pair, in
        # both directions); NCCL ignores tags and would need Megatron's fused exchanges.
        raise ValueError(
            f"schedule='interleaved' needs the gloo backend (tag-matched P2P), got {backend!r}; "
            "use schedule='1f1b' on this backend"
        )
    if p2p is None:
        return "eager" if backend in GLOO_P2P else "grouped"
    return p2p  # "eager" or "grouped", by Pipeline's argument check


def _check_config(schedule_name: str, chunks: int) -> None:
    if chunks > 1 and schedule_name != "interleaved":
        raise ValueError(
            f"chunks={chunks} needs schedule='interleaved', got schedule={schedule_name!r}"
        )


def _layers(name: str, value: Any, where: str) -> object:
    what = "an nn.Sequential or a list of modules"
    check_instance(name, value, nn.Sequential | list | tuple, what, where=where)
    with part_of(name, value, where):
        for i, layer in enumerate(value):
            check_module(f"{name}[{i}]", layer)
    return value


class Pipeline(nn.Module):
    """Pipeline-parallel training of a layer list across the ranks of ``group``.

    Args:
        layers: The whole model as layers run in order (a list or ``nn.Sequential``); every
            rank passes the same list, built the same way. Only this rank's layers are kept.
        group: The pipeline's process group (None: the default group); stage = group rank.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zbh1"`` (zero bubble: each
            backward in two passes, the weights' deferred into the bubbles).
        micro_batches: Micro-batches per step; must divide the batch size.
        loss_fn: ``loss_fn(output, target)`` of one micro-batch, a mean over its samples.
        chunks: Model chunks per rank (interleaved only).
        balance: ``None``, ``"params"``, ``"time"`` or layers per virtual stage (a list of
            ``group size * chunks`` ints); see :func:`~phalanx.pipeline.split_layers`.
        example_input: First layer's input, for ``balance="time"`` (measured on group rank 0).
        broadcast_loss: Return the loss on every rank, not only the last stage.
        device: Where the stage runs; default: its parameters' device.
        p2p: ``"eager"``: post every send at once and receives a few actions ahead, so
            transfers overlap compute (gloo's threads move the data in the background);
            ``"grouped"``: post each action's receives with the previous action's sends as one
            ``batch_isend_irecv`` group (NCCL, which needs both sides of a transfer posted and
            runs a rank pair's transfers on one stream). Default: eager on gloo, else grouped.
            Interleaved needs gloo (its several boundaries per rank pair are told apart by tag).

    After :meth:`step`, ``max_in_flight`` (and ``max_in_flight_per_chunk``) tell how many
    micro-batches' activations this rank held at once; ``comm`` is the P2P transport.
    """

    @checked(
        layers=_layers,
        group=GROUP,
        schedule=rule(check_choice, choices=SCHEDULES),
        micro_batches=rule(check_int, min=1),
        loss_fn=rule(check_callable, fix="loss_fn(output, target) -> a scalar tensor"),
        chunks=rule(check_int, min=1),
        balance=optional(balance_arg),
        broadcast_loss=FLAG,
        device=optional(rule(check_instance, types=str | torch.device, what="a device")),
        p2p=optional(rule(check_choice, choices=("eager", "grouped"))),
    )
    def __init__(
        self,
        layers: Sequence[nn.Module] | nn.Sequential,
        group: dist.ProcessGroup | None,
        *,
        schedule: str = "1f1b",
        micro_batches: int,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        chunks: int = 1,
        balance: Sequence[int] | str | None = None,
        example_input: Any = None,
        broadcast_loss: bool = False,
        device: torch.device | str | None = None,
        p2p: str | None = None,
    ) -> None:
        super().__init__()
        _check_config(schedule, chunks)
        self.group = group
        self.num_ranks, self.rank = _group_info(group)
        self.schedule, self.num_microbatches, self.num_chunks = schedule, micro_batches, chunks
        self.loss_fn, self.broadcast_loss = loss_fn, broadcast_loss
        self.num_stages = self.num_ranks * chunks
        if balance is not None and not isinstance(balance, str) and len(balance) != self.num_stages:
            raise ValueError(
                f"balance has {len(balance)} stages but the group has {self.num_ranks} ranks x "
                f"chunks={chunks} = {self.num_stages} stages"
            )
        mods = list(layers)
        agreed = self._agreed_balance(mods, balance, example_input)
        parts = split_layers(mods, self.num_stages, agreed)
        self.stage_ids = [c * self.num_ranks + self.rank for c in range(chunks)]
        self.stages = nn.ModuleList(Chunk(mods, parts[s]) for s in self.stage_ids)
        self.device = self._pick_device(device)
        self.actions: list[Action] = make_schedule(
            schedule, self.num_ranks, micro_batches, self.rank, chunks
        )
        self.max_in_flight, self.max_in_flight_per_chunk = 0, [0] * chunks
        self.p2p = _p2p_mode(group, p2p, schedule, self.num_ranks)
        self.comm = Comm(group, micro_batches, grouped=self.p2p == "grouped")
        self._inbound, self._outbound = build_ports(
            self.comm, self.stage_ids, self.num_stages, self.rank, self.device
        )
        self._weight_passes: dict[tuple[int, int], WeightPass] = {}
        self.on_action: Callable[[str], None] | None = None
        """Called with "forward" / "backward" before each action of :meth:`step` (the job's
        phase clock: a receive waited for is then counted in the phase that needed it)."""

    @property
    def is_first(self) -> bool:
        """This rank runs the first stage (it needs the real inputs)."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """This rank runs the last stage (it needs the targets and returns the loss)."""
        return self.rank == self.num_ranks - 1

    def _agreed_balance(self, mods: list[nn.Module], balance: Any, example: Any) -> Any:
        """Measured times differ between ranks: group rank 0 measures, everyone uses its split."""
        if balance != "time" or self.num_ranks == 1:
            return balance
        costs = torch.full((len(mods),), float("nan"), dtype=torch.float64)
        if self.rank == 0 and example is not None:
            costs = torch.tensor(time_costs(mods, example), dtype=torch.float64)
        broadcast(costs, self._global_rank(0), group=self.group)
        if costs.isnan().any():  # every rank learns it, so none waits for the others
            raise ValueError("balance='time' needs example_input= on group rank 0")
        return balance_stages(costs.tolist(), self.num_stages)

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _pick_device(self, device: torch.device | str | None) -> torch.device:
        if device is not None:
            self.stages.to(device)
            return torch.device(device)
        for p in self.stages.parameters():
            return p.device
        from phalanx.comm import world

        return world().device

    # ---- one training step -------------------------------------------------------------

    def step(self, inputs: Any = None, targets: Any = None) -> torch.Tensor | None:
        """Pipelined forward and backward of one batch; gradients accumulate into ``.grad``.

        Args:
            inputs: The batch (tensor or tuple of tensors); needed on the first stage only.
            targets: The targets; needed on the last stage only.

        Returns:
            The batch loss (mean over micro-batches, detached) on the last stage, or on every
            rank with ``broadcast_loss=True``; None elsewhere.
        """
        xs = self._split(inputs, "inputs") if self.is_first else None
        ys = self._split(targets, "targets") if self.is_last else None
        self._begin_step()
        live: _Live = {}
        losses: list[torch.Tensor] = []
        for i, a in enumerate(self.actions):
            if self.on_action is not None:
                self.on_action("forward" if a.kind == "F" else "backward")
            self._prefetch(i)
            if a.kind == "F":
                self._forward(a, xs, ys, live, losses)
                self._count_in_flight(live)
            elif a.kind == "B":
                self._backward(a, live)
            elif a.kind == "I":
                self._backward_input(a, live)
            else:
                backward_weight(self._weight_passes.pop((a.microbatch, a.chunk)))
                del live[(a.microbatch, a.chunk)]  # its activations go with its graph
        self.comm.wait_sends()
        loss = torch.stack(losses).sum() if losses else None
        return self._share_loss(loss) if self.broadcast_loss else loss

    def _split(self, batch: Any, name: str) -> list[tuple[Any, ...]]:
        if batch is None:
            raise ValueError(f"Pipeline.step: this rank runs a stage that needs {name}, got None")
        return [
            tuple(t.to(self.device) for t in mb)
            for mb in split_batch(batch, self.num_microbatches, name)
        ]

    def _begin_step(self) -> None:
        self.max_in_flight, self.max_in_flight_per_chunk = 0, [0] * self.num_chunks
        self._weight_passes.clear()  # a step that raised left its graphs here
        for port in [*self._inbound, *self._outbound]:
            if port is not None:
                port.begin_step(early=self.p2p == "eager")

    def _prefetch(self, i: int) -> None:
        """Post the receives of the next few actions so their transfers overlap compute."""
        for a in self.actions[i : i + 1 + (LOOKAHEAD if self.p2p == "eager" else 0)]:
            if a.kind == "F" and self._inbound[a.chunk] is not None:
                self._inbound[a.chunk].post(a.microbatch)
            elif a.kind in "BI" and self._outbound[a.chunk] is not None:
                self._outbound[a.chunk].post_grads(a.microbatch)

    def _forward(
        self, a: Action, xs: Any, ys: Any, live: _Live, losses: list[torch.Tensor]
    ) -> None:
        c, mb = a.chunk, a.microbatch
        inbound = self._inbound[c]
        x = xs[mb] if inbound is None else inbound.take(mb)
        out = self.stages[c](*x)
        if self._outbound[c] is None:  # the last stage: the loss, scaled for a batch mean
            y = ys[mb]
            loss = self.loss_fn(out, y[0] if len(y) == 1 else y) / self.num_microbatches
            losses.append(loss.detach())
            live[(mb, c)] = (x, (loss,))
            return
        outs = as_tuple(out)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise TypeError(
                f"pipeline stage {self.stage_ids[c]} must return tensors, "
                f"got {[type(o).__name__ for o in outs]}"
            )
        self._outbound[c].send(mb, outs)
        live[(mb, c)] = (x, outs)

    def _backward(self, a: Action, live: _Live) -> None:
        c, mb = a.chunk, a.microbatch
        x, outs = live.pop((mb, c))
        outbound = self._outbound[c]
        grads = None if outbound is None else outbound.take_grads(mb)
        tensors = [o for o in outs if o.requires_grad]
        if tensors:
            torch.autograd.backward(tensors, grads)
        if self._inbound[c] is not None:
            self._inbound[c].send_grads(mb, x)

    def _backward_input(self, a: Action, live: _Live) -> None:
        """ZB's ``I``: the input's gradient, sent at once; the weights' wait for ``W``."""
        c, mb = a.chunk, a.microbatch
        x, outs = live[(mb, c)]
        outbound = self._outbound[c]
        grads = None if outbound is None else outbound.take_grads(mb)
        tensors = [o for o in outs if o.requires_grad]
        inputs = [t for t in x if isinstance(t, torch.Tensor)]
        _, work = backward_input(tensors, grads, inputs, self.stages[c].parameters())
        self._weight_passes[(mb, c)] = work
        if self._inbound[c] is not None:
            self._inbound[c].send_grads(mb, x)

    def _count_in_flight(self, live: _Live) -> None:
        self.max_in_flight = max(self.max_in_flight, len(live))
        for c in range(self.num_chunks):
            held = sum(1 for _, chunk in live if chunk == c)
            self.max_in_flight_per_chunk[c] = max(self.max_in_flight_per_chunk[c], held)

    def _share_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """Broadcast the last stage's loss (value and dtype) to every rank of the group."""
        box = torch.zeros(2, dtype=torch.float64, device=self.device)
        if loss is not None:
            box[0], box[1] = loss.double(), DTYPES.index(loss.dtype)
        if self.num_ranks > 1:
            broadcast(box, self._global_rank(self.num_ranks - 1), group=self.group)
        return box[0].to(DTYPES[int(box[1])])

    # ---- forward only --------------------------------------------------------------------

    @torch.no_grad()
    def eval_step(self, inputs: Any = None) -> Any:
        """Forward-only pipelined pass; returns the output (whole batch) on the last stage.

        Other ranks return None. Uses the schedule's forward order; nothing is kept for backward.
        """
        xs: Any = self._split(inputs, "inputs") if self.is_first else None
        self._begin_step()
        outputs: dict[int, Any] = {}
        for a in (a for a in self.actions if a.kind == "F"):
            c, mb = a.chunk, a.microbatch
            inbound = self._inbound[c]
            out = self.stages[c](*(xs[mb] if inbound is None else inbound.take(mb)))
            if self._outbound[c] is None:
                outputs[mb] = out
            else:
                self._outbound[c].send(mb, as_tuple(out))
        self.comm.wait_sends()
        return _concat([outputs[mb] for mb in sorted(outputs)]) if outputs else None

    def forward(self, *inputs: Any) -> Any:
        """Evaluation: :meth:`eval_step` on ``inputs`` (no gradients)."""
        return self.eval_step(inputs if len(inputs) != 1 else inputs[0])


def _concat(outputs: list[Any]) -> Any:
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    return tuple(torch.cat(parts) for parts in zip(*outputs))
