"""One precision vocabulary for ``phalanx.Job(precision=)`` and ``phalanx plan --precision``.

=================  ===========================================================  ==============
name               what is stored and computed                                  model states
=================  ===========================================================  ==============
``fp32``           everything in fp32                                           4 + 4 + K
``bf16-mixed``     bf16 autocast around the forward; fp32 parameters, gradients  4 + 4 + K
                   and optimizer state (the master weights are the parameters)
``fp16-mixed``     as ``bf16-mixed`` in fp16, with a gradient scaler            4 + 4 + K
``bf16-true``      parameters, gradients, optimizer state and inputs in bf16    2 + 2 + K/2
``fp16-master``    the ZeRO paper's mixed precision: fp16 parameters and        2 + 2 + (K+4)
                   gradients, an fp32 master copy in the optimizer state
=================  ===========================================================  ==============

(bytes per parameter: parameters + gradients + optimizer state, K being the optimizer's fp32
state, 8 for Adam; Lightning's names where it has one.) ``fp16-master`` is what DeepSpeed and
the ZeRO paper's formulas assume; ``phalanx plan`` estimates it, ``Job`` does not train in it.

Old spellings keep their meaning where they had one everywhere: ``bf16`` is ``bf16-mixed`` and
``fp16`` is ``fp16-mixed`` (``Job``'s meaning; ``phalanx plan --precision bf16`` used to mean
pure bf16, now spelled ``bf16-true``), ``mixed`` (``phalanx plan``'s default) is
``fp16-master``. Pure Python: the planner imports it without torch's training code.
"""

from __future__ import annotations

from phalanx._check import fail

__all__ = ["ALIASES", "JOB_PRECISIONS", "PRECISIONS", "check_precision", "precision_name"]

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-master")
"""Every precision, by its one name."""

JOB_PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")
"""The precisions ``phalanx.Job`` trains in."""

ALIASES = {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "mixed": "fp16-master"}
"""Older spellings, each meaning what it meant wherever it was accepted."""


def precision_name(value: str) -> str | None:
    """The one name of ``value`` (a name or an alias); None when it is neither."""
    if value in PRECISIONS:
        return value
    return ALIASES.get(value)


def check_precision(
    name: str, value: object, *, where: str = "", allowed: tuple[str, ...] = PRECISIONS
) -> str:
    """``value`` as its one name, if it is one of ``allowed`` (or an alias of one).

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: an unknown precision, or one not in ``allowed``, naming the argument, the
            value and the accepted names (the one names; the aliases stay accepted, unlisted).
    """
    what = "one of " + ", ".join(repr(n) for n in allowed)  # the one names: aliases are old
    if not isinstance(value, str):
        raise fail(name, value, what, where=where, error=TypeError)
    found = precision_name(value)
    if found is None or found not in allowed:
        raise fail(name, value, what, where=where, fix=_why_not(value, found))
    return found


def _why_not(value: str, found: str | None) -> str:
    """Why a known precision is refused (only ``fp16-master`` is: ``Job`` does not train in it)."""
    if found is None:
        return ""
    said = repr(found) if found == value else f"{value!r} means {found!r}, which"
    return f"{said} is for `phalanx plan` estimates only"
