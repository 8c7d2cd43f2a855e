"""Read a pickle that holds only plain data, without running anything the bytes say.

torch's Flight Recorder writes its dumps as pickles (protocol 2) of dicts, lists, tuples,
strings, numbers, booleans and None (each frame dict shared by every entry whose stack holds it),
and only that form carries the stack frames. :func:`loads_plain` builds that value with
:class:`~phalanx._pickle_machine.PlainMachine`: nothing the file names is imported or called,
and every value is bounded (depth, expanded size, shared references, hashed keys) before
anything walks it.
"""

from __future__ import annotations

from phalanx._pickle_machine import Malformed, PlainMachine, Refused

__all__ = ["UnsafePickleError", "loads_plain"]


class UnsafePickleError(ValueError):
    """The bytes are not a plain-data pickle: they would import or call code, exceed a bound,
    or are malformed."""


def loads_plain(data: bytes, source: str = "<bytes>") -> object:
    """The value a plain-data pickle holds (dicts, lists, tuples, sets, str, bytes, numbers, bool,
    None), built without importing or calling anything the bytes name.

    Raises:
        UnsafePickleError: naming ``source``, for an opcode that would run code or build an
            object, for a value past the bounds of :mod:`phalanx._pickle_machine`, and for
            malformed bytes.
    """
    try:
        return PlainMachine(len(data)).run(data)
    except Malformed as exc:
        raise UnsafePickleError(f"{source}: not a well-formed pickle ({exc})") from None
    except Refused as exc:
        raise UnsafePickleError(
            f"{source}: refused to unpickle: {exc}; only plain data (dicts, lists, strings, "
            "numbers) is read, as torch's Flight Recorder writes it"
        ) from None
