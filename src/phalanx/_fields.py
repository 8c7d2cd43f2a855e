"""Options objects checked on construction: a frozen dataclass's fields against their rules.

``phalanx.DDP(...)``, ``phalanx.Zero(...)``, ``phalanx.Mesh(...)`` and the other strategy options
call :func:`check_fields` from ``__post_init__``, with the rules of :mod:`phalanx._check`.
"""

from __future__ import annotations

from phalanx._check import Rule

__all__ = ["check_fields"]


def check_fields(options: object, **rules: Rule) -> None:
    """Check a frozen dataclass's fields by their rules, keeping what each rule returns (a numpy
    integer as an ``int``); errors name the class, the field and the value."""
    where = type(options).__name__
    for name, check in rules.items():
        object.__setattr__(options, name, check(name, vars(options)[name], where))
