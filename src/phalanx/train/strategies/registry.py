"""Strategies by name: the presets ``Job("zero2")`` resolves, and users' own strategies.

Every built-in strategy is registered here and nowhere else (torchtitan keeps one registry of
builders the same way); ``register_strategy`` adds a user's class under a name of its own.
"""

from __future__ import annotations

import ast
import logging
import os
from collections.abc import Callable

from phalanx._check import FLAG, check_str, checked, fail, rule
from phalanx.train.strategies.base import Strategy
from phalanx.train.strategies.ddp import DDP
from phalanx.train.strategies.hogwild import Hogwild
from phalanx.train.strategies.local_sgd import DiLoCo, LocalSGD
from phalanx.train.strategies.mesh import Mesh
from phalanx.train.strategies.ps import PS
from phalanx.train.strategies.single import DP, Single
from phalanx.train.strategies.streaming_diloco import StreamingDiLoCo
from phalanx.train.strategies.torch_ddp import TorchDDP
from phalanx.train.strategies.torch_fsdp import TorchFSDP
from phalanx.train.strategies.torch_zero import TorchZero1
from phalanx.train.strategies.zero import Zero

__all__ = [
    "OVERRIDE_VAR",
    "overridden",
    "parse_strategy",
    "register_strategy",
    "resolve",
    "strategy_names",
]

log = logging.getLogger(__name__)

OVERRIDE_VAR = "PHALANX_STRATEGY"
"""Set, it replaces the strategy every ``phalanx.Job`` of the process was given (a preset name
or a call such as ``Mesh(tp=2)``; see :func:`parse_strategy`): how ``phalanx verify`` runs an
unchanged script under another strategy."""

Preset = Callable[[], Strategy]
"""Makes the strategy a name stands for (a class with default options, or a function)."""

_PRESETS: dict[str, Preset] = {
    "ddp": DDP,
    "torch-ddp": TorchDDP,
    "dp": DP,
    "single": Single,
    "zero1": lambda: Zero(stage=1),
    "zero2": lambda: Zero(stage=2),
    "zero3": lambda: Zero(stage=3),
    "torch-zero1": TorchZero1,
    "torch-fsdp": TorchFSDP,
    "pipeline": lambda: Mesh(dp=1, pp=None),  # every rank a stage
    "tensor": lambda: Mesh(dp=1, tp=None),  # every layer split over every rank
    "ps-sync": lambda: PS(mode="sync"),
    "ps-async": lambda: PS(mode="async"),
    "ssp": lambda: PS(mode="ssp"),  # needs a bound: the error says phalanx.PS(staleness=)
    "hogwild": Hogwild,
    "localsgd": LocalSGD,
    "diloco": DiLoCo,
    "streaming-diloco": StreamingDiLoCo,
}


def _preset(name: str, value: object, where: str) -> object:
    if isinstance(value, Strategy) or (isinstance(value, type) and issubclass(value, Strategy)):
        return value
    what = "a phalanx.train.Strategy subclass or instance"
    raise fail(name, value, what, where=where, error=TypeError)


@checked(name=rule(check_str), strategy=_preset, replace=FLAG)
def register_strategy(
    name: str, strategy: type[Strategy] | Strategy, *, replace: bool = False
) -> None:
    """Make ``strategy`` (a class, built with its defaults, or an instance) ``Job(name)``."""
    if name in _PRESETS and not replace:
        raise ValueError(f"strategy {name!r} is already registered; pass replace=True")
    _PRESETS[name] = strategy if isinstance(strategy, type) else lambda: strategy


def strategy_names() -> list[str]:
    """Every registered strategy name, sorted."""
    return sorted(_PRESETS)


def resolve(strategy: str | Strategy, where: str = "Job") -> Strategy:
    """The strategy a preset name stands for (or ``strategy`` itself); errors list the names."""
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        what = "a preset name or a strategy (phalanx.DDP(), phalanx.Zero(stage=2), ...)"
        raise fail("strategy", strategy, what, where=where, error=TypeError)
    if strategy not in _PRESETS:
        raise ValueError(f"strategy={strategy!r} is not one of {', '.join(strategy_names())}")
    return _PRESETS[strategy]()


_CLASSES: dict[str, type[Strategy]] = {
    cls.__name__: cls
    for cls in (DDP, DP, DiLoCo, Hogwild, LocalSGD, Mesh, PS, Single, StreamingDiLoCo, Zero)
}


def parse_strategy(text: str, where: str = OVERRIDE_VAR) -> Strategy:
    """The strategy ``text`` spells: a preset name (``"zero3"``) or a strategy class called with
    literal keyword arguments (``"Mesh(tp=2)"``, ``"Zero(stage=3)"``). Nothing is evaluated:
    the call is read from its syntax tree.

    Raises:
        ValueError: naming ``where``, the text and what it may be.
    """
    text = text.strip()
    if text in _PRESETS:
        return resolve(text, where)
    usage = (
        f"{where}={text!r} is neither a strategy name ({', '.join(strategy_names())}) nor a "
        f"call of {', '.join(sorted(_CLASSES))} with literal keyword arguments, "
        f"e.g. 'Zero(stage=3)' or 'Mesh(tp=2)'"
    )
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise ValueError(usage) from None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
        raise ValueError(usage)
    cls = _CLASSES.get(node.func.id)
    if cls is None or any(k.arg is None for k in node.keywords):
        raise ValueError(usage)
    try:
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except ValueError:
        raise ValueError(usage) from None
    try:
        return cls(**kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}={text!r}: {exc}") from None


def overridden(strategy: Strategy) -> Strategy:
    """``strategy``, or the one :data:`OVERRIDE_VAR` names when it is set (said by rank 0)."""
    text = os.environ.get(OVERRIDE_VAR, "").strip()
    if not text:
        return strategy
    chosen = parse_strategy(text)
    if chosen != strategy and os.environ.get("RANK", "0") == "0":
        log.warning("strategy %r from %s replaces the script's %r", chosen, OVERRIDE_VAR, strategy)
    return chosen
