"""The rules of ``Job(...)``'s arguments, checked before the job creates its process group.

One row per argument, with the shared checks of :mod:`phalanx._check`; what depends on the world
size (degrees that must divide it, servers that must leave workers) is checked later, by
``parallel_config`` and ``ps_config``, which name the world size too.
"""

from __future__ import annotations

from typing import Any

from phalanx._check import (
    FLAG,
    check_choice,
    check_float,
    check_instance,
    check_int,
    check_path,
    checked,
    fail,
    optional,
    part_of,
    rule,
)
from phalanx.comm.group import BACKENDS
from phalanx.pipeline.balance import balance_arg
from phalanx.pipeline.schedules import SCHEDULES
from phalanx.train.precision import PRECISIONS

__all__ = ["check_epochs", "check_job_args"]

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts


def _strategy(name: str, value: Any, where: str) -> str:
    from phalanx.train.strategies import strategy_names  # registered ones, users' included

    return check_choice(name, value, strategy_names(), where=where)


def _tp_plan(name: str, value: Any, where: str) -> object:
    from phalanx.tensor_parallel.plan import plan_arg  # tensor parallelism, only if asked for

    return plan_arg(name, value, where)


def _straggler(name: str, value: Any, where: str) -> object:
    if not isinstance(value, tuple) or len(value) != 2:
        what = "a (who, factor) pair, e.g. (1, 4.0) or ('random', 4.0)"
        raise fail(name, value, what, where=where, error=TypeError)
    who, factor = value
    with part_of(name, value, where):
        if who != "random":
            check_int("who", who, min=0, fix="who is a rank, or 'random'")
        check_float("factor", factor, min=1, fix="factor is how many times slower")
    return value


def _straggler_rule(name: str, value: Any, where: str) -> object:
    from phalanx.train.stragglers import StragglerRule

    what = "a phalanx.train.stragglers.StragglerRule"
    return check_instance(name, value, StragglerRule, what, where=where)


_path = optional(rule(check_path))
_degree = optional(rule(check_int, min=1))

check_job_args = checked(
    strategy=_strategy,
    precision=rule(check_choice, choices=PRECISIONS),
    grad_accum=rule(check_int, min=1),
    seed=rule(check_int, min=SEED_RANGE[0], max=SEED_RANGE[1]),
    checkpoint_dir=_path,
    keep_last=rule(check_int, min=1),
    metrics_file=_path,
    tensorboard_dir=_path,
    profile_dir=_path,
    backend=optional(rule(check_choice, choices=BACKENDS, fold_case=True)),
    dp=_degree,
    pp=_degree,
    tp=_degree,
    micro_batches=rule(check_int, min=1),
    schedule=rule(check_choice, choices=SCHEDULES),
    chunks=rule(check_int, min=1),
    balance=optional(balance_arg),
    tp_plan=optional(_tp_plan),
    servers=_degree,
    staleness=optional(rule(check_int, min=0)),
    staleness_lr=FLAG,
    max_updates=_degree,
    straggler=optional(_straggler),
    straggler_check_every=rule(check_int, min=0),
    straggler_rule=optional(_straggler_rule),
)
"""Decorates ``Job.__init__``: every argument the caller passed, checked by its row."""


def check_epochs(n: object) -> int:
    """``Job.epochs(n)``'s argument: the number of epochs, an int >= 0."""
    return check_int("n", n, min=0, where="Job.epochs")
