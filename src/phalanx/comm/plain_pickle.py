"""Read a pickle that holds only plain data, without running anything the bytes say.

``pickle.load`` imports and calls whatever the bytes name (``GLOBAL`` then ``REDUCE``), so a
crafted file runs code. torch's Flight Recorder writes its dumps as pickles (protocol 2) of
dicts, lists, tuples, strings, numbers, booleans and None, and only that form carries the stack
frames. :func:`loads_plain` walks the opcodes with :func:`pickletools.genops`, a parser that
builds nothing, and builds those values itself. An opcode that would import a name, call it or
build an object (``GLOBAL``, ``STACK_GLOBAL``, ``REDUCE``, ``BUILD``, ``INST``, ``OBJ``,
``NEWOBJ``, ``EXT1``, ``PERSID``, ...) is refused before anything is created: no code from the
file can run, whatever it holds.
"""

from __future__ import annotations

import pickletools
from typing import TypeVar

__all__ = ["UnsafePickleError", "loads_plain"]

_SCALARS = frozenset(
    {
        *("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT"),
        *("STRING", "BINSTRING", "SHORT_BINSTRING"),
        *("UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"),
        *("BINBYTES", "SHORT_BINBYTES", "BINBYTES8"),
    }
)
"""Opcodes whose argument is the value (a number, a string or bytes)."""
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_EMPTY = {"EMPTY_DICT": dict, "EMPTY_LIST": list, "EMPTY_TUPLE": tuple, "EMPTY_SET": set}
_FROM_MARK = {"LIST": list, "TUPLE": tuple, "FROZENSET": frozenset}
_TUPLE_N = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
_NOTHING = frozenset({"PROTO", "FRAME"})
_T = TypeVar("_T")


class UnsafePickleError(ValueError):
    """The bytes are not a plain-data pickle: they would import or call code, or are malformed."""


class _Refused(Exception):
    pass


class _Machine:
    """The pickle stack machine for plain data only."""

    def __init__(self) -> None:
        self.stack: list[object] = []
        self.marks: list[int] = []
        self.memo: dict[object, object] = {}

    def pop_mark(self) -> list[object]:
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def step(self, name: str, arg: object, pos: int | None) -> None:
        """Apply one opcode; raise :class:`_Refused` for one outside plain data."""
        if name in _NOTHING:
            return
        if name in _SCALARS:
            self.stack.append(arg)
        elif name in _CONSTANTS:
            self.stack.append(_CONSTANTS[name])
        elif name in _EMPTY:
            self.stack.append(_EMPTY[name]())
        elif not (self._containers(name) or self._memo_and_stack(name, arg)):
            raise _Refused(f"opcode {name} at byte {pos} would import, call or build an object")

    def _containers(self, name: str) -> bool:
        if name in _FROM_MARK:
            self.stack.append(_FROM_MARK[name](self.pop_mark()))
        elif name in _TUPLE_N:
            n = _TUPLE_N[name]
            if len(self.stack) < n:
                raise IndexError(f"{name} on a stack of {len(self.stack)}")
            packed = tuple(self.stack[-n:])
            del self.stack[-n:]
            self.stack.append(packed)
        elif name == "DICT":
            items = self.pop_mark()
            self.stack.append(dict(zip(items[::2], items[1::2], strict=True)))
        elif name in ("APPEND", "APPENDS"):
            items = [self.stack.pop()] if name == "APPEND" else self.pop_mark()
            _of(self.stack[-1], list).extend(items)
        elif name == "SETITEM":
            value, key = self.stack.pop(), self.stack.pop()
            _of(self.stack[-1], dict)[key] = value
        elif name == "SETITEMS":
            items = self.pop_mark()
            _of(self.stack[-1], dict).update(zip(items[::2], items[1::2], strict=True))
        elif name == "ADDITEMS":
            items = self.pop_mark()
            _of(self.stack[-1], set).update(items)
        else:
            return False
        return True

    def _memo_and_stack(self, name: str, arg: object) -> bool:
        if name in _PUT:
            self.memo[arg] = self.stack[-1]
        elif name == "MEMOIZE":
            self.memo[len(self.memo)] = self.stack[-1]
        elif name in _GET:
            self.stack.append(self.memo[arg])
        elif name == "MARK":
            self.marks.append(len(self.stack))
        elif name == "POP":
            self.stack.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            self.stack.append(self.stack[-1])
        else:
            return False
        return True


def _of(value: object, kind: type[_T]) -> _T:
    if not isinstance(value, kind):
        raise TypeError(f"expected a {kind.__name__} on the stack, found {type(value).__name__}")
    return value


def loads_plain(data: bytes, source: str = "<bytes>") -> object:
    """The value a plain-data pickle holds (dicts, lists, tuples, sets, str, bytes, numbers, bool,
    None), built without importing or calling anything the bytes name.

    Raises:
        UnsafePickleError: naming ``source``, for an opcode that would run code or build an
            object, and for malformed bytes.
    """
    machine = _Machine()
    try:
        for op, arg, pos in pickletools.genops(data):
            if op.name == "STOP":
                return machine.stack.pop()
            machine.step(op.name, arg, pos)
    except _Refused as exc:
        raise UnsafePickleError(
            f"{source}: refused to unpickle: {exc}; only plain data (dicts, lists, strings, "
            "numbers) is read, as torch's Flight Recorder writes it"
        ) from None
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise UnsafePickleError(f"{source}: not a well-formed pickle ({exc})") from None
    raise UnsafePickleError(f"{source}: not a well-formed pickle (no STOP opcode)")
