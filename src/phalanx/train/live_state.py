"""What a live job's members hand each other: the whole training state, in memory.

After a membership change the members all-gather their committed step counts; the first member
at the highest count sends :func:`collect`'s tree to every member behind it (a replacement, a
survivor whose last step failed while the others' completed, or a first member that the set-up's
broadcast of rank 0's model did not reach) with :func:`phalanx.recovery.send_state`, and each
receiver :func:`apply`-s it. Objects a newcomer
has not built yet when it receives (the loader's sampler, tracked objects) keep their part in
:class:`Pending` until they exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx.checkpoint.sections import unwrap
from phalanx.data.ledger import SampleLedger
from phalanx.recovery import rng_state, set_rng_state
from phalanx.recovery.transfer import receive_state, send_state

if TYPE_CHECKING:  # annotations only
    from phalanx.train.strategies.base import Runner
    from phalanx.train.train_state import TrainState

__all__ = ["Held", "apply", "collect", "exchange"]

OWN_START = -1
"""The standing of a first member without the job's common start: the set-up's broadcast of
rank 0's model did not reach it, so it holds only its own initialisation."""
NO_STATE = -2
"""The standing of a member without any training state (a replacement)."""


@dataclass
class Held:
    """The live job's sample ledger, and received parts whose objects do not exist yet."""

    ledger: SampleLedger | None = None
    """Sample ids of every committed step (all ranks'), from the job's first step on."""
    sampler: dict[str, Any] | None = None
    """A received sampler state, until ``job.loader`` builds the sampler."""
    ledger_state: dict[str, Any] | None = None
    """A received ledger, until the sampler (which it describes) exists."""
    tracked: dict[str, Any] = field(default_factory=dict)
    """Received states of objects not tracked yet, by name."""

    def settle(self, state: TrainState) -> None:
        """Load what the job has built since it received (call after ``loader`` / ``track``)."""
        if state.sampler is not None and self.sampler is not None:
            state.sampler.load_state_dict(self.sampler)
            self.sampler = None
        if state.sampler is not None and self.ledger_state is not None:
            self.ledger, self.ledger_state = SampleLedger.from_dict(self.ledger_state), None
        for name in [n for n in self.tracked if n in state.tracked]:
            state.tracked[name].load_state_dict(self.tracked.pop(name))


def _module(runner: Runner) -> torch.nn.Module:
    """The model without its wrapper (DDP's), as checkpoints save it."""
    model, _ = runner.checkpointed(saving=True)
    assert model is not None, "the live job's model is set up before any exchange"
    return unwrap(model)


def collect(
    runner: Runner, train: TrainState, held: Held, sharded: bool = False
) -> dict[str, object]:
    """This member's training state: model, optimizer, scheduler, sampler, ledger, RNG, step.

    ``sharded`` (ZeRO): without the parameters and the optimizer, which peers restore from
    their shard mirrors (``train/live_zero.py``); the model's buffers instead, by position.
    """
    sampler = train.sampler
    state: dict[str, object] = {
        "step": train.step,
        "epoch": train.epoch,
        "resumed_extra": dict(train.resumed_extra),
        "rng": rng_state(),
        "sampler": sampler.state_dict() if sampler is not None else held.sampler,
        "ledger": held.ledger.to_dict() if held.ledger is not None else held.ledger_state,
        "tracked": {
            **held.tracked,
            **{name: obj.state_dict() for name, obj in train.tracked.items()},
        },
    }
    if sharded:
        model = runner.model
        assert model is not None
        state["buffers"] = [b.detach() for b in model.buffers()]  # sent or copied at once
    else:
        _, optimizer = runner.checkpointed(saving=True)
        state["model"] = _module(runner).state_dict()
        if optimizer is not None:
            state["optim"] = optimizer.state_dict()
    if train.scheduler is not None:
        state["scheduler"] = train.scheduler.state_dict()
    if train.scaler is not None:
        state["scaler"] = train.scaler.state_dict()
    return state


def apply(runner: Runner, train: TrainState, state: dict[str, Any], held: Held) -> None:
    """Load a received state into ``runner``'s objects and ``train`` (and ``held``: what the
    job has not built yet)."""
    if "model" in state:
        _module(runner).load_state_dict(state["model"])
        _, optimizer = runner.checkpointed(saving=False)
        if optimizer is not None and "optim" in state:
            optimizer.load_state_dict(state["optim"])
    if "buffers" in state:
        model = runner.model
        assert model is not None
        with torch.no_grad():
            for mine, got in zip(model.buffers(), state["buffers"], strict=True):
                mine.copy_(got)
    if train.scheduler is not None and "scheduler" in state:
        train.scheduler.load_state_dict(state["scheduler"])
    if train.scaler is not None and "scaler" in state:
        train.scaler.load_state_dict(state["scaler"])
    train.step, train.epoch = int(state["step"]), int(state["epoch"])
    train.resumed_extra = dict(state.get("resumed_extra", {}))
    train.resumed = True  # the state came from a live member: no checkpoint to resume from
    set_rng_state(state["rng"])
    held.sampler, held.ledger_state, held.tracked = (
        state["sampler"],
        state["ledger"],
        dict(state["tracked"]),
    )
    held.ledger = None
    held.settle(train)


def exchange(
    runner: Runner,
    train: TrainState,
    stateful: bool,
    held: Held,
    sharded: bool = False,
    started: bool = True,
) -> tuple[int, list[int]] | None:
    """Bring every member to the highest committed step; returns (source rank, receivers), or
    None when all were there already. ``stateful``: this member holds a training state;
    ``sharded``: as :func:`collect`'s; ``started``: its state is the job's common start (False
    on a first member that the set-up's broadcast did not reach: it is behind every member
    that holds the start). When no member holds the start (its root was lost before its
    broadcast reached anyone), the first member's own initialisation becomes it.

    Collective over the current default group. Raises ``RuntimeError`` when no member holds
    a state (every holder was lost at once).
    """
    standing = train.step if stateful and started else OWN_START if stateful else NO_STATE
    mine = torch.tensor([standing], dtype=torch.int64)
    counts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, mine)
    steps = [int(c.item()) for c in counts]
    top = max(steps)
    if top == NO_STATE:
        raise RuntimeError(
            "live recovery: no member of the new generation holds the training state (all "
            "holders were lost at once); restart the job from its newest checkpoint"
        )
    src = steps.index(top)
    behind = [r for r, s in enumerate(steps) if s < top or (top == OWN_START and r != src)]
    if not behind:
        return None
    rank = dist.get_rank()
    if rank == src:
        send_state(collect(runner, train, held, sharded), behind)
    elif rank in behind:
        apply(runner, train, receive_state(src), held)
    return src, behind
