"""The probe of ``phalanx verify``: what each rank of a verified run records, step by step.

``phalanx verify`` (:mod:`.cli`) runs the user's script under ``phalanx run`` with
``PHALANX_VERIFY_DIR`` set. Every ``phalanx.Job`` made then gets this observer, which:

- before each optimizer step, writes a snapshot of step ``s`` into ``DIR/snapshots`` with
  :func:`phalanx.checkpoint.save`: the model's parameters and buffers, the optimizer's state
  and param groups, and the gradients the optimizer is about to apply, entered for that one
  save as an extra optimizer state entry ``grad`` of each parameter, so that every strategy's
  own checkpoint form (replicated, ZeRO pieces, tensor-parallel shards) stores them and
  :func:`~phalanx.checkpoint.interop_state.read_state` reads them back whole, at any world size;
- adds up the losses given to ``job.backward`` during the step and writes their mean over every
  rank and micro-step to ``DIR/losses.jsonl`` (rank 0);
- after the last step (``PHALANX_VERIFY_STEPS``) writes the state once more without gradients
  and ends the process with status 0;
- with ``PHALANX_VERIFY_SAVE_AT=k``, commits the job's own checkpoint of step ``k`` and ends
  there (the interrupted half of ``--mode resume``);
- with ``PHALANX_VERIFY_CHECKPOINTS=D``, a job that checkpoints keeps its checkpoints in ``D``
  instead of the script's ``checkpoint_dir`` (each verified run starts clean, and never
  resumes from the user's own checkpoints; the resumed half of a resume reads the saved half's);
- with ``PHALANX_VERIFY_PERTURB=SEED``, scales the gradient of every loss given to
  ``job.backward`` by ``1 ± eps`` (the sign drawn from ``SEED``, the rank and the backward), so
  each rank's contribution to the gradient reduction moves by about one unit in its last place:
  the rounding a reordered reduction makes, which gives the noise bound a divergence is
  measured against.

Only lockstep jobs can be verified (every rank steps together): a parameter server, Hogwild,
local SGD or live recovery is refused with the reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.train import observers
from phalanx.train.observers import JobView, ObservedJob

__all__ = [
    "ENV_CHECKPOINTS",
    "ENV_DIR",
    "ENV_PERTURB",
    "ENV_SAVE_AT",
    "ENV_STEPS",
    "GRAD_KEY",
    "LOSSES",
    "NAMES",
    "SNAPSHOTS",
    "VerifyProbe",
    "attach",
]

ENV_DIR = "PHALANX_VERIFY_DIR"
ENV_STEPS = "PHALANX_VERIFY_STEPS"
ENV_SAVE_AT = "PHALANX_VERIFY_SAVE_AT"
ENV_CHECKPOINTS = "PHALANX_VERIFY_CHECKPOINTS"
ENV_PERTURB = "PHALANX_VERIFY_PERTURB"

SNAPSHOTS = "snapshots"
"""The folder of a run's per-step snapshots (checkpoints named ``step-NNNNNN``)."""
LOSSES = "losses.jsonl"
"""One line per step: ``{"step": s, "loss": mean}`` (rank 0)."""
NAMES = "names.json"
"""The parameters' names in the optimizer's order (rank 0), where the job can tell them."""
GRAD_KEY = "grad"
"""The optimizer state entry a snapshot stores each parameter's gradient under."""


def _int(env: Mapping[str, str], name: str, least: int) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        raise ValueError(f"{name}={raw!r} must be an integer >= {least}")
    return value


class VerifyProbe:
    """Records one rank's steps of a verified run (see the module's docstring).

    Args:
        job: The job observed.
        directory: ``PHALANX_VERIFY_DIR``: where the run's snapshots and losses go.
        steps: Stop after this many optimizer steps (None: when the script ends).
        save_at: Commit the job's checkpoint of this step and stop there (None: never).
        perturb: Seed of the loss-gradient nudge of a noise twin (None: none).
    """

    def __init__(
        self,
        job: ObservedJob,
        directory: str,
        steps: int | None = None,
        save_at: int | None = None,
        perturb: int | None = None,
    ) -> None:
        self.job = job
        self.directory = Path(directory)
        self.steps, self.save_at, self.perturb = steps, save_at, perturb
        self._loss_sum = 0.0
        self._loss_count = 0
        self._main = job.world.rank == 0
        self._named = False
        self._backwards = 0
        if self._main:
            (self.directory / SNAPSHOTS).mkdir(parents=True, exist_ok=True)

    # ---- the observer protocol ---------------------------------------------------------------
    def phase(self, name: str | None) -> None:
        pass

    def relabel(self, name: str) -> None:
        pass

    def loss(self, value: torch.Tensor) -> None:
        self._loss_sum += float(value.detach().float().sum())
        self._loss_count += value.numel()
        if self.perturb is not None and value.requires_grad:
            value.register_hook(self._nudge())

    def stepping(self, step: int) -> None:
        """The step's gradients are final: snapshot them."""
        if not self._named:
            self._named = True
            self._write_names()
        self._write_loss(step)
        self._snapshot(step, with_grads=True)

    def stepped(self, step: int) -> None:
        if self.save_at is not None and step >= self.save_at:
            self.job.save(async_=False)
            raise SystemExit(0)
        if self.steps is not None and step >= self.steps:
            self._snapshot(step + 1, with_grads=False)  # the state the last step left
            raise SystemExit(0)

    def saved(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass

    # ---- what it records ---------------------------------------------------------------------
    def _nudge(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The hook that scales a loss's gradient by ``1 ± eps``: every gradient this rank
        contributes to the reduction moves by about one unit in its last place, up or down
        (drawn per rank and backward from the seed), so the reduced sum moves as much as a
        reordered one would, cancellations included."""
        self._backwards += 1
        draw = (self.perturb or 0) * 1_000_003 + self.job.world.rank * 10_007 + self._backwards
        coin = torch.randint(0, 2, (1,), generator=torch.Generator().manual_seed(draw))
        sign = 1.0 if int(coin) else -1.0

        def nudge(grad: torch.Tensor) -> torch.Tensor:
            return grad * (1.0 + sign * torch.finfo(grad.dtype).eps)

        return nudge

    def _write_names(self) -> None:
        """The names of the optimizer's parameters, where the user's optimizer steps the
        model's own parameters (the runs of a strategy that rebuilds the optimizer, ZeRO's or a
        Mesh's, take their names from the reference's by place)."""
        model, optimizer = self.job.model, self.job.optimizer
        if not self._main or model is None or optimizer is None:
            return
        if self.job.strategy.rebuilds_optimizer or self.job.runner.groups is not None:
            return  # flat parameters (ZeRO), a stage's or a shard's (Mesh): not the model's
        known = {id(p): name for name, p in model.named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if all(id(p) in known for p in params):
            names = [_unwrapped(known[id(p)]) for p in params]
            (self.directory / NAMES).write_text(json.dumps(names))

    def _write_loss(self, step: int) -> None:
        world = self.job.world
        totals = torch.tensor([self._loss_sum, float(self._loss_count)], dtype=torch.float64)
        self._loss_sum, self._loss_count = 0.0, 0
        if world.world_size > 1:
            moved = totals.to(world.device)
            dist.all_reduce(moved)
            totals = moved.cpu()
        if self._main:
            total, count = totals.tolist()
            record = {"step": step, "loss": total / count if count else None}
            with open(self.directory / LOSSES, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _snapshot(self, step: int, with_grads: bool) -> None:
        from phalanx import checkpoint

        model, optimizer = self.job.runner.checkpointed(saving=True)
        if optimizer is None:
            raise ValueError(
                "phalanx verify compares the optimizer's state and the gradients it applies: "
                "pass the optimizer to job.setup(model, optimizer)"
            )
        with _grads_in_state(optimizer) if with_grads else nullcontext():
            checkpoint.save(
                self.directory / SNAPSHOTS,
                step,
                model=model,
                optimizer=optimizer,
                keep_last=None,
                async_=False,
                replicas_equal=self.job.runner.strategy.replicas_equal,
            )


def _unwrapped(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (DDP's ``module.``), as the model's
    saved state names it."""
    while name.startswith(("module.", "_orig_mod.")):
        name = name.split(".", 1)[1]
    return name


def _stepping(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state a checkpoint stores: ZeRO-1/2's inner one, over this rank's
    ranges, whose gradients it reduces first (a no-op after a synchronised backward)."""
    from phalanx.sharding.zero import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.owned_grads()
        return optimizer.optim
    return optimizer


@contextmanager
def _grads_in_state(saved: torch.optim.Optimizer) -> Iterator[None]:
    """Each parameter's gradient as its optimizer state entry :data:`GRAD_KEY`, for one save."""
    entered: list[dict[str, Any]] = []
    optimizer = _stepping(saved)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                state = optimizer.state[p]
                state[GRAD_KEY] = p.grad.detach()
                entered.append(state)
    try:
        yield
    finally:
        for state in entered:
            state.pop(GRAD_KEY, None)
        for p in [p for p, s in optimizer.state.items() if not s]:  # none before: none after
            del optimizer.state[p]


def attach(view: JobView, env: Mapping[str, str] | None = None) -> VerifyProbe | None:
    """A probe for the job ``view`` describes when ``PHALANX_VERIFY_DIR`` is set."""
    env = os.environ if env is None else env
    directory = env.get(ENV_DIR, "").strip()
    if not directory or view.job is None:
        return None
    job = view.job
    if not view.lockstep:
        why = "live recovery" if view.live else f"strategy {job.strategy.name!r}"
        raise ValueError(
            f"phalanx verify compares runs step by step, and {why} does not step every rank "
            f"together; verify a lockstep strategy (ddp, zero1/2/3, a Mesh)"
        )
    steps = _int(env, ENV_STEPS, 1)
    save_at = _int(env, ENV_SAVE_AT, 1)
    perturb = _int(env, ENV_PERTURB, 0)
    if save_at is not None and job.checkpoints.directory is None:
        raise ValueError(
            "phalanx verify --mode resume needs a job that checkpoints: "
            "phalanx.Job(..., checkpoint_dir=...)"
        )
    checkpoints = env.get(ENV_CHECKPOINTS, "").strip()
    if checkpoints and job.checkpoints.directory is not None:
        job.checkpoints.directory = checkpoints  # this run's own, never the script's
    return VerifyProbe(job, directory, steps, save_at, perturb)


observers.register(attach)
