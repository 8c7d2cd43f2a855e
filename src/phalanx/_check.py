"""Argument checks for the public API: one message style, raised before any work starts.

    Job(grad_accum='4'): grad_accum must be an int >= 1, got str '4'

Each ``check_*`` function returns the value as the library uses it (a numpy integer as an
``int``, a number of seconds as a ``timedelta``...) or raises ``TypeError`` (wrong type) or
``ValueError`` (right type, wrong value) naming the call, the argument and the value. ``bool``
is not an int here, although Python says it is: ``grad_accum=True`` is a mistake.

:func:`checked` applies such checks declaratively to a function's arguments, so a constructor
with many options lists its rules in one table (see ``train/job_args.py``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import operator
import os
import pickle
import sys
from collections.abc import Callable, Collection, Iterator, Sized
from datetime import timedelta
from types import UnionType
from typing import Any, ParamSpec, TypeVar, get_args

__all__ = [
    "Rule",
    "check_bool",
    "check_callable",
    "check_choice",
    "check_dataset",
    "check_device",
    "check_float",
    "check_group",
    "check_instance",
    "check_int",
    "check_ints",
    "check_module",
    "check_path",
    "check_picklable",
    "check_str",
    "check_tensor",
    "check_timeout",
    "checked",
    "fail",
    "optional",
    "part_of",
    "rule",
    "shown",
]

P = ParamSpec("P")
R = TypeVar("R")

Rule = Callable[[str, Any, str], object]
"""``rule(name, value, where)``: raise if ``value`` is not acceptable for argument ``name``."""


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a module's repr can fill a screen)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fail(
    name: str,
    value: object,
    what: str,
    *,
    where: str = "",
    fix: str = "",
    error: type[Exception] = ValueError,
) -> Exception:
    """The exception for argument ``name`` that is not ``what``; the caller raises it.

    ``where`` names the call (``"Job"`` gives ``Job(name=value): ...``); ``fix`` is appended.
    """
    head = f"{where}({name}={shown(value)}): " if where else ""
    got = "None" if value is None else f"{type(value).__name__} {shown(value)}"
    tail = f"; {fix}" if fix else ""
    return error(f"{head}{name} must be {what}, got {got}{tail}")


def _is_bool(value: object) -> bool:
    numpy = sys.modules.get("numpy")  # a numpy bool exists only if numpy was imported
    return isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_))


def _bounds(kind: str, low: float | None, high: float | None, above: float | None) -> str:
    if above is not None:
        return f"{kind} > {_num(above)}" + (f" and <= {_num(high)}" if high is not None else "")
    if low is not None and high is not None:
        return f"{kind} in {_num(low)}..{_num(high)}"
    if low is not None:
        return f"{kind} >= {_num(low)}"
    return f"{kind} <= {_num(high)}" if high is not None else kind


def _num(x: float | None) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def check_int(
    name: str,
    value: object,
    *,
    min: int | None = None,
    max: int | None = None,
    where: str = "",
    fix: str = "",
) -> int:
    """``value`` as an ``int`` (numpy integers included, bools not) in ``min..max``."""
    what = _bounds("an int", min, max, None)
    if _is_bool(value):
        raise fail(name, value, what, where=where, fix=fix, error=TypeError)
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise fail(name, value, what, where=where, fix=fix, error=TypeError) from None
    if (min is not None and number < min) or (max is not None and number > max):
        raise fail(name, value, what, where=where, fix=fix)
    return number


def check_ints(
    name: str,
    value: object,
    *,
    min: int | None = None,
    max: int | None = None,
    where: str = "",
    fix: str = "",
) -> list[int]:
    """A list or tuple of ints, each in ``min..max`` (an element's error names its index)."""
    if not isinstance(value, list | tuple):
        what = "a list of " + _bounds("ints", min, max, None)
        raise fail(name, value, what, where=where, fix=fix, error=TypeError)
    with part_of(name, value, where):
        return [
            check_int(f"{name}[{i}]", v, min=min, max=max, fix=fix) for i, v in enumerate(value)
        ]


@contextlib.contextmanager
def part_of(name: str, value: object, where: str) -> Iterator[None]:
    """Prefix the errors of checks on parts of argument ``name`` (its elements, the halves of a
    pair) with the whole argument: ``Job(balance=[2, 'a']): balance[1] must be an int...``."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        if not where:
            raise
        raise type(exc)(f"{where}({name}={shown(value)}): {exc}") from None


def check_float(
    name: str,
    value: object,
    *,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    where: str = "",
    fix: str = "",
) -> float:
    """``value`` as a finite ``float`` in ``min..max`` (or ``> above``); ints are numbers too."""
    what = _bounds("a number", min, max, above)
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise fail(name, value, what, where=where, fix=fix, error=TypeError)
    number = float(value)
    low_ok = (min is None or number >= min) and (above is None or number > above)
    if not math.isfinite(number) or not low_ok or (max is not None and number > max):
        raise fail(name, value, what, where=where, fix=fix)
    return number


def check_bool(name: str, value: object, *, where: str = "", fix: str = "") -> bool:
    """``value`` as a ``bool``: True / False, or 0 / 1 as torch's drop-ins read them; ``"no"``,
    ``2`` and ``None`` are refused, not read as truth."""
    if not _is_bool(value) and not (type(value) is int and value in (0, 1)):
        raise fail(name, value, "True or False", where=where, fix=fix, error=TypeError)
    return bool(value)


def check_device(name: str, value: object, *, where: str = "", fix: str = "") -> Any:
    """A device as torch's arguments take one: an index (numpy integers too), a str, a
    ``torch.device``; an index comes back as an ``int``."""
    import torch

    if isinstance(value, (str, torch.device)):
        return value
    if not _is_bool(value):
        with contextlib.suppress(TypeError):
            return operator.index(value)  # type: ignore[arg-type]
    raise fail(
        name, value, "an int, a str or a torch.device", where=where, fix=fix, error=TypeError
    )


def check_str(name: str, value: object, *, where: str = "", fix: str = "") -> str:
    """A non-empty ``str``."""
    if not isinstance(value, str):
        raise fail(name, value, "a non-empty str", where=where, fix=fix, error=TypeError)
    if not value:
        raise fail(name, value, "a non-empty str", where=where, fix=fix)
    return value


def check_choice(
    name: str,
    value: object,
    choices: Collection[str],
    *,
    where: str = "",
    fix: str = "",
    fold_case: bool = False,
) -> str:
    """One of ``choices`` (compared lower-cased with ``fold_case``); returns it as compared."""
    what = "one of " + ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise fail(name, value, what, where=where, fix=fix, error=TypeError)
    key = value.lower() if fold_case else value
    if key not in choices:
        raise fail(name, value, what, where=where, fix=fix)
    return key


def check_path(name: str, value: object, *, where: str = "", fix: str = "") -> Any:
    """A filesystem path (``str`` or ``os.PathLike``), not empty; returned as given."""
    what = "a path (str or os.PathLike)"
    if not isinstance(value, str | os.PathLike):
        raise fail(name, value, what, where=where, fix=fix, error=TypeError)
    path = os.fspath(value)
    if not isinstance(path, str):  # a bytes path
        raise fail(name, value, what, where=where, fix=fix, error=TypeError)
    if not path:
        raise fail(name, value, "a non-empty path", where=where, fix=fix)
    return value


def check_instance(
    name: str,
    value: object,
    types: type | UnionType | tuple[type, ...],
    what: str,
    *,
    where: str = "",
    fix: str = "",
) -> Any:
    """``value`` itself when it is an instance of ``types`` (described to the user as ``what``).

    A bool is refused unless ``bool`` itself is one of ``types`` (``int`` is not enough).
    """
    members = types if isinstance(types, tuple) else get_args(types) or (types,)
    if not isinstance(value, types) or (_is_bool(value) and bool not in members):
        raise fail(name, value, what, where=where, fix=fix, error=TypeError)
    return value


def check_module(name: str, value: object, *, where: str = "", fix: str = "") -> Any:
    """A ``torch.nn.Module``."""
    from torch import nn

    return check_instance(name, value, nn.Module, "an nn.Module", where=where, fix=fix)


def check_tensor(name: str, value: object, *, where: str = "", fix: str = "") -> Any:
    """A ``torch.Tensor``."""
    import torch

    return check_instance(name, value, torch.Tensor, "a torch.Tensor", where=where, fix=fix)


def check_group(name: str, value: object, *, where: str = "", fix: str = "") -> Any:
    """A ``torch.distributed.ProcessGroup`` or None (the default group)."""
    import torch.distributed as dist

    if value is None:
        return None
    what = "a torch.distributed.ProcessGroup or None (the default group)"
    return check_instance(name, value, dist.ProcessGroup, what, where=where, fix=fix)


def check_callable(name: str, value: object, *, where: str = "", fix: str = "") -> Any:
    """``value`` itself when it can be called."""
    if not callable(value):
        raise fail(name, value, "callable", where=where, fix=fix, error=TypeError)
    return value


def check_picklable(name: str, value: object, *, where: str = "", fix: str = "") -> Any:
    """A callable that a ``spawn`` / ``forkserver`` process can receive: pickled by name.

    Checked here rather than in ``Process.start()``, where the error names no argument.
    """
    check_callable(name, value, where=where, fix=fix)
    qualname = getattr(value, "__qualname__", repr(value))
    why = ""
    if "<lambda>" in qualname or "<locals>" in qualname:
        why = "a lambda or a function defined inside another function cannot be pickled"
    else:
        try:
            pickle.dumps(value)
        except Exception as exc:  # pickle raises PicklingError, AttributeError or TypeError
            why = f"pickling it failed: {exc}"
    if why:
        what = "a module-level function (new processes import it by name)"
        fix = f"{why}; define it at module level, in an importable module or in the script " + (
            "guarded by `if __name__ == '__main__':`"
        )
        raise fail(name, value, what, where=where, fix=fix, error=TypeError)
    return value


def check_dataset(name: str, value: object, *, where: str = "", fix: str = "") -> Any:
    """A map-style dataset: one with a length (``__len__``)."""
    fix = fix or "iterable datasets (without __len__) shard themselves"
    return check_instance(
        name, value, Sized, "a map-style dataset (with __len__)", where=where, fix=fix
    )


def check_timeout(name: str, value: object, *, where: str = "", fix: str = "") -> timedelta:
    """Seconds (an int or a float) or a ``timedelta``, positive and finite."""
    raw = value.total_seconds() if isinstance(value, timedelta) else value
    what = "a positive number of seconds or a datetime.timedelta"
    if _is_bool(raw) or not isinstance(raw, numbers.Real):
        raise fail(name, value, what, where=where, fix=fix, error=TypeError)
    seconds = float(raw)
    if not (math.isfinite(seconds) and seconds > 0):
        raise fail(name, value, what, where=where, fix=fix)
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def rule(check: Callable[..., object], **options: Any) -> Rule:
    """A :data:`Rule` from a ``check_*`` function and its options: ``rule(check_int, min=1)``."""

    def apply(name: str, value: Any, where: str) -> object:
        return check(name, value, where=where, **options)

    return apply


def optional(inner: Rule) -> Rule:
    """``inner``, or None."""

    def apply(name: str, value: Any, where: str) -> object:
        return None if value is None else inner(name, value, where)

    return apply


def checked(
    where: str | None = None, /, **rules: Rule
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Check the arguments a caller passed against ``rules`` (by parameter name) before the call.

    The function receives what each rule returns (a numpy integer as an ``int``...). Arguments
    left at their defaults are not checked. The message names the call ``where``, by default
    the function's qualified name (the class, for ``__init__``). The wrapper is one more frame
    between the caller and the body: a warning issued in the body needs one more ``stacklevel``.
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(fn)
        unknown = set(rules) - set(signature.parameters)
        assert not unknown, f"rules for parameters {fn.__qualname__} does not have: {unknown}"
        name = where or fn.__qualname__.removesuffix(".__init__")

        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return fn(*args, **kwargs)  # Python's own message for a wrong call
            for arg, value in bound.arguments.items():
                check = rules.get(arg)
                if check is not None:
                    bound.arguments[arg] = check(arg, value, name)
            return fn(*bound.args, **bound.kwargs)

        return call

    return decorate


FLAG = rule(check_bool)
"""The rule of a bool argument (``find_unused_parameters``, ``shuffle``...)."""
GROUP = rule(check_group)
"""The rule of a ``process_group`` / ``group`` argument."""
MODULE = rule(check_module)
"""The rule of a ``module`` / ``model`` argument."""
