"""The rules of ``Job(...)``'s arguments, checked before the job creates its process group.

One row per argument, with the shared checks of :mod:`phalanx._check`; a strategy's own options
are checked when it is built (``phalanx.Mesh(pp=0)`` fails there), and what depends on the world
size (degrees that must divide it, servers that must leave workers) by ``Strategy.start``.
"""

from __future__ import annotations

from typing import Any

from phalanx._check import (
    check_bool,
    check_choice,
    check_float,
    check_instance,
    check_int,
    check_path,
    checked,
    fail,
    optional,
    rule,
)
from phalanx.comm.group import BACKENDS
from phalanx.precisions import JOB_PRECISIONS, check_precision

__all__ = ["check_clip", "check_epochs", "check_job_args", "check_slow_down"]

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts


def _strategy(name: str, value: Any, where: str) -> object:
    from phalanx.train.strategies import Strategy, strategy_names  # users' presets included

    if isinstance(value, Strategy):
        return value
    if isinstance(value, str):
        return check_choice(name, value, strategy_names(), where=where)
    what = "a preset name or a strategy (phalanx.DDP(), phalanx.Zero(stage=2), ...)"
    raise fail(name, value, what, where=where, error=TypeError)


def _who(name: str, value: Any, where: str) -> object:
    if value == "random":
        return value
    return check_int(name, value, min=0, where=where, fix="who is a rank, or 'random'")


check_slow_down = checked(
    who=_who, factor=rule(check_float, min=1, fix="factor is how many times slower")
)
"""Decorates ``Job.slow_down``: the injected straggler's rank and factor."""


def _straggler_rule(name: str, value: Any, where: str) -> object:
    from phalanx.train.straggler_rule import StragglerRule

    what = "a phalanx.train.StragglerRule"
    return check_instance(name, value, StragglerRule, what, where=where)


def _activation_checkpointing(name: str, value: Any, where: str) -> object:
    from phalanx.activation_checkpointing.policy import to_policy

    return to_policy(value, where=where)


_path = optional(rule(check_path))

check_job_args = checked(
    strategy=_strategy,
    precision=rule(check_precision, allowed=JOB_PRECISIONS),
    grad_accum=rule(check_int, min=1),
    seed=optional(rule(check_int, min=SEED_RANGE[0], max=SEED_RANGE[1])),
    checkpoint_dir=_path,
    keep_last=rule(check_int, min=1),
    metrics_file=_path,
    tensorboard_dir=_path,
    profile_dir=_path,
    timeline_dir=_path,
    backend=optional(rule(check_choice, choices=BACKENDS, fold_case=True)),
    straggler_check_every=rule(check_int, min=0),
    straggler_rule=optional(_straggler_rule),
    recovery=optional(rule(check_choice, choices=("live", "live-exact", "restart"))),
    save_on_sigterm=rule(check_bool),
    skip_nonfinite=rule(check_bool),
    activation_checkpointing=optional(_activation_checkpointing),
)
"""Decorates ``Job.__init__``: every argument the caller passed, checked by its row."""


def check_epochs(n: object) -> int:
    """``Job.epochs(n)``'s argument: the number of epochs, an int >= 0."""
    return check_int("n", n, min=0, where="Job.epochs")


def check_clip(max_norm: object, norm_type: object) -> tuple[float, float]:
    """``Job.clip_grad_norm_``'s arguments: ``max_norm`` > 0, ``norm_type`` > 0 or inf."""
    where = "Job.clip_grad_norm_"
    max_norm = check_float("max_norm", max_norm, above=0, where=where)
    if norm_type == float("inf"):
        return max_norm, float("inf")
    fix = "e.g. 2.0, 1.0 or float('inf')"
    return max_norm, check_float("norm_type", norm_type, above=0, where=where, fix=fix)
