"""The pickle machine: read a pickle as plain data, building every value itself, with bounds.

``pickle.load`` imports and calls whatever the bytes name (``GLOBAL`` then ``REDUCE``), so a
crafted file runs code; and even plain values can hang whoever reads them: a few hundred bytes
of shared references (each level of a tuple holding the previous level twice) make 2**40
values, which a ``hash``, a walk or a ``repr`` never finishes. :class:`PlainMachine` walks the
opcodes with :func:`pickletools.genops`, a parser that builds nothing, and builds the values
itself: dicts, lists, tuples, sets, strings, bytes, numbers, booleans and None. An opcode that
would import a name, call it or build an object (``GLOBAL``, ``REDUCE``, ``BUILD``, ``INST``,
``NEWOBJ``, ``PERSID``, ``EXT1``, ...) has no handler and is refused before anything is created.

Every value is bounded as it is built, before anything hashes, walks or ``repr``s it:

- **Depth**: at most :attr:`PlainMachine.max_depth` levels of nesting.
- **Stack**: at most :attr:`PlainMachine.max_stack` values on the pickle stack at once.
- **Expanded size**: a value's weight counts every reference it holds in full (a list holding
  one tuple twice weighs twice the tuple), a long string, bytes or int by its length (one per
  64 bytes); no value may weigh more than :attr:`PlainMachine.expansion` per byte of input, so
  walking or printing what was read costs time in proportion to the file.
- **Sharing**: a second reference (``GET``, ``DUP``) to a list, dict or set seals it: nothing
  is added to it afterwards, so the weight counted stays true and no container holds itself.
- **Hashing**: a dict key or set item is a string, bytes, None, a bool, a float, an int of at
  most 1024 bits, or a flat tuple of at most 16 of those, so hashing one takes bounded time.

Refusals are :class:`Refused` (:class:`Malformed` for bytes that are no pickle) naming the byte,
their messages showing types and sizes (:func:`brief`), never the ``repr`` of a container.

Two readers use it: ``diagnostics/plain_pickle.py`` (torch's Flight Recorder dumps: plain data,
as is) and ``checkpoint/dcp_pickle.py`` (DCP's ``.metadata``: a subclass adds handlers to
:attr:`PlainMachine.ops` for the globals, records and calls it allows, and tightens the bounds).
"""

from __future__ import annotations

import pickletools
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

__all__ = ["Handler", "Malformed", "PlainMachine", "Refused", "brief", "hash_bounded"]

_UNIT = 64
"""Bytes of a string, bytes or int that weigh as much as one value."""
_MAX_KEY_ITEMS = 16
_MAX_KEY_INT_BITS = 1024
_KEY_SCALARS = frozenset({str, bytes, type(None), bool, float})
_SHIFT = 48
"""Bits of a weight in :attr:`PlainMachine.info` (no weight exceeds the budget, checked first;
an int, not a tuple: the collector does not track it, so building a value costs no extra GC)."""
_MASK = (1 << _SHIFT) - 1
_MUTABLE = frozenset({list, dict, set})
_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})
"""What a second reference needs no :meth:`PlainMachine.share` for: it cannot change."""
_SMALL = frozenset({"BININT", "BININT1", "BININT2", "FLOAT", "BINFLOAT"})
"""Opcodes whose argument is a value of weight one."""
_SIZED = frozenset(
    {
        *("INT", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING", "SHORT_BINSTRING"),
        *("UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"),
        *("BINBYTES", "SHORT_BINBYTES", "BINBYTES8"),
    }
)
"""Opcodes whose argument is a value weighed by its length."""
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_TUPLE_N = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}

Handler = Callable[[Any], object]
"""What an opcode does, given the argument :func:`pickletools.genops` decoded."""


class Refused(Exception):
    """The machine refuses the bytes; the message says why (never the repr of a container)."""


class Malformed(Refused):
    """The bytes are not a well-formed pickle (no such opcode, a pop of an empty stack...)."""


def _refuse(why: str, kind: type[Refused] = Refused) -> NoReturn:
    raise kind(why)


def brief(value: object) -> str:
    """What ``value`` is, in a few words: bounded whatever the file holds."""
    if type(value) is str:
        return repr(value) if len(value) <= 60 else f"a string of {len(value)} characters"
    if type(value) is bytes:
        return repr(value) if len(value) <= 60 else f"{len(value)} bytes"
    if type(value) is int:
        bits = value.bit_length()
        return repr(value) if bits <= 64 else f"an int of {bits} bits"
    if value is None or type(value) is bool or type(value) is float:
        return repr(value)
    if type(value) in (tuple, list, dict, set, frozenset):
        return f"a {type(value).__name__} of {len(value)} items"  # type: ignore[arg-type]
    return f"a {type(value).__name__}"


def _weight(value: object) -> int:
    """The weight of a scalar: one per :data:`_UNIT` bytes."""
    if type(value) is int:
        return 1 + value.bit_length() // (8 * _UNIT)
    if type(value) is str or type(value) is bytes:
        return 1 + len(value) // _UNIT
    return 1


def hash_bounded(key: object) -> bool:
    """Whether hashing ``key`` takes bounded time (see the module docstring)."""
    if type(key) in _KEY_SCALARS:
        return True  # a string's and bytes' hash is computed once, then cached
    if type(key) is int:
        return key.bit_length() <= _MAX_KEY_INT_BITS
    if type(key) is not tuple or len(key) > _MAX_KEY_ITEMS:
        return False
    return all(type(k) is not tuple and hash_bounded(k) for k in key)


class PlainMachine:
    """The pickle stack machine for plain data, with the bounds of the module docstring.

    A subclass adds handlers to :attr:`ops` (an opcode's name -> its :data:`Handler`) and may
    override :meth:`share`, :meth:`key_ok`, :meth:`describe` and :meth:`unknown`; the values it
    builds go through :meth:`track` so that they count in the bounds.
    """

    max_depth = 100
    """Most levels of nesting (torch's dumps and DCP's metadata need about 6)."""
    max_stack = 1_000_000
    """Most values on the stack at once (torch's own pickler puts a whole list there)."""
    expansion = 16
    """Most weight a value may have per byte of input (a shared 3-key frame dict in a Flight
    Recorder dump weighs about 4 per byte of its reference)."""

    def __init__(self, size: int) -> None:
        self.stack: list[object] = []
        self.marks: list[int] = []
        self.memo: dict[object, object] = {}
        self.budget = min(self.expansion * size, _MASK)
        self.info: dict[int, int] = {}  # id -> depth << _SHIFT | weight, unless (0, 1)
        self.alive: list[object] = []  # keeps the ids in info unique while the machine runs
        self.sealed: set[int] = set()  # ids of lists, dicts and sets with a second reference
        self.pop: Callable[[], object] = self.stack.pop  # IndexError: malformed (see run)
        push = self.push = self.stack.append  # run checks the stack's height after each opcode
        self.ops: dict[str, Handler] = {
            "PROTO": _ignore,
            "FRAME": _ignore,
            **dict.fromkeys(_SMALL, push),
            **dict.fromkeys(_SIZED, self.sized),
            **{name: _constant(push, value) for name, value in _CONSTANTS.items()},
            **{name: self.tuple_of(n) for name, n in _TUPLE_N.items()},
            "TUPLE": lambda _: self.new_filled(tuple, self.pop_mark()),
            "EMPTY_LIST": lambda _: push(self.track([], ())),
            "EMPTY_DICT": lambda _: push(self.track({}, ())),
            "EMPTY_SET": lambda _: push(self.track(set(), ())),
            "LIST": lambda _: self.new_filled(list, self.pop_mark()),
            "DICT": lambda _: self.new_filled(dict, self.pop_mark()),
            "FROZENSET": lambda _: self.new_filled(frozenset, self.pop_mark()),
            "APPEND": lambda _: self.fill(list, [self.pop()]),
            "APPENDS": lambda _: self.fill(list, self.pop_mark()),
            "SETITEM": lambda _: self.fill(dict, [*reversed((self.pop(), self.pop()))]),
            "SETITEMS": lambda _: self.fill(dict, self.pop_mark()),
            "ADDITEMS": lambda _: self.fill(set, self.pop_mark()),
            **dict.fromkeys(("PUT", "BINPUT", "LONG_BINPUT"), self.put),
            "MEMOIZE": self.memoize,
            **dict.fromkeys(("GET", "BINGET", "LONG_BINGET"), self.get),
            "DUP": lambda _: push(self.share(self.stack[-1])),
            "MARK": lambda _: self.marks.append(len(self.stack)),
            "POP": lambda _: self.pop(),
            "POP_MARK": lambda _: self.pop_mark(),
        }

    # ---- hooks a subclass may override -------------------------------------------------------

    def share(self, value: object) -> object:
        """``value``, given a second reference by ``GET`` or ``DUP`` (a container is sealed)."""
        if type(value) in _MUTABLE:
            self.sealed.add(id(value))
        return value

    def key_ok(self, key: object) -> bool:
        """Whether ``key`` may be a dict key or a set item (its hash is bounded)."""
        return hash_bounded(key)

    def describe(self, value: object) -> str:
        """``value`` in a few words, for an error message."""
        return brief(value)

    def unknown(self, name: str) -> str:
        """Why the opcode ``name``, which has no handler, is refused."""
        return f"opcode {name} would import, call or build an object"

    # ---- the bounds of every value built -----------------------------------------------------

    def track(self, value: object, children: Iterable[object], weight: int = 0) -> Any:
        """Count ``children`` into ``value``'s depth and weight (from what it had, or for a new
        value one level and one value, or a scalar's ``weight``); refuse it past the bounds."""
        info = self.info
        key = id(value)
        had = info.get(key)
        if had is None:
            self.alive.append(value)
            depth, weight = (0, weight) if weight else (1, 1)
        else:
            depth, weight = had >> _SHIFT, had & _MASK
        for found in map(info.get, map(id, children)):
            if found is None:  # a small scalar
                weight += 1
            else:
                weight += found & _MASK
                if found >> _SHIFT >= depth:
                    depth = (found >> _SHIFT) + 1
        if depth > self.max_depth:
            _refuse(f"values nested deeper than {self.max_depth} levels")
        if weight > self.budget:
            _refuse(
                f"a {type(value).__name__} of {weight} values counting shared references, "
                f"more than {self.budget} ({self.expansion} per byte of the input)"
            )
        info[key] = depth << _SHIFT | weight
        return value

    def pop_mark(self) -> list[object]:
        if not self.marks:
            _refuse("an opcode needs a MARK that is not there", Malformed)
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def check_keys(self, keys: list[object], what: str) -> None:
        key_ok = self.key_ok
        for key in keys:
            if not key_ok(key):
                _refuse(f"{what} that is {self.describe(key)}, whose hash may not be bounded")

    def checked_dict(self, items: list[object]) -> dict[object, object]:
        """The dict of ``items`` (keys and values in turn), its keys checked before hashing."""
        if len(items) % 2:
            _refuse("a dict given an odd number of keys and values", Malformed)
        keys = items[::2]
        self.check_keys(keys, "a dict key")
        return dict(zip(keys, items[1::2], strict=True))

    # ---- the opcodes (self.ops maps each name to one of these) -------------------------------

    def sized(self, value: object) -> None:
        weight = _weight(value)
        self.push(self.track(value, (), weight) if weight > 1 else value)

    def tuple_of(self, n: int) -> Handler:
        def handler(_: object) -> None:
            stack = self.stack
            if len(stack) < n:
                _refuse(f"a tuple of {n} on a stack of {len(stack)}", Malformed)
            items = stack[len(stack) - n :]
            del stack[len(stack) - n :]
            stack.append(self.track(tuple(items), items))

        return handler

    def new_filled(self, kind: type, items: list[object]) -> None:
        if kind is dict:
            value: object = self.checked_dict(items)
        else:
            if kind is frozenset:
                self.check_keys(items, "a set item")
            value = kind(items)
        self.push(self.track(value, items))

    def fill(self, kind: type, items: list[object]) -> None:
        """Add ``items`` to the ``kind`` on top of the stack, keys checked before hashing."""
        target = self.stack[-1]
        if type(target) is not kind:
            found = self.describe(target)
            _refuse(f"expected a {kind.__name__} on the stack, found {found}", Malformed)
        if id(target) in self.sealed:
            _refuse(f"items added to a {kind.__name__} after a second reference to it")
        if type(target) is dict:
            target.update(self.checked_dict(items))
        elif type(target) is set:
            self.check_keys(items, "a set item")
            target.update(items)
        elif type(target) is list:
            target.extend(items)
        self.track(target, items)

    def put(self, index: object) -> None:
        self.memo[index] = self.stack[-1]

    def memoize(self, _: object) -> None:
        memo = self.memo
        memo[len(memo)] = self.stack[-1]

    def get(self, index: object) -> None:
        try:
            value = self.memo[index]
        except KeyError:
            _refuse(f"memo entry {brief(index)} does not exist", Malformed)
        self.push(value if type(value) in _SCALARS else self.share(value))

    def run(self, data: bytes) -> object:
        """The value pickled in ``data``.

        Raises:
            Refused: naming the byte, for anything outside the machine's opcodes or bounds
                (:class:`Malformed` for bytes that are no pickle).
        """
        ops, stack, most = self.ops, self.stack, self.max_stack
        pos: int | None = 0
        try:
            for op, arg, pos in pickletools.genops(data):  # noqa: B007 (pos: for the message)
                handler = ops.get(op.name)
                if handler is not None:
                    handler(arg)
                    if len(stack) > most:
                        _refuse(f"more than {most} values on the pickle stack at once")
                elif op.name == "STOP":
                    return self.pop()
                else:
                    _refuse(self.unknown(op.name))
        except Refused as exc:
            raise type(exc)(f"{exc} (at byte {pos})") from None
        except IndexError:
            raise Malformed(f"an opcode needs a value on an empty stack (at byte {pos})") from None
        except ValueError as exc:  # from genops: an unknown opcode, truncated data, a bad argument
            raise Malformed(f"{exc} (after byte {pos})") from None
        _refuse("no STOP opcode", Malformed)


def _ignore(arg: object) -> None:
    pass


def _constant(push: Callable[[object], None], value: object) -> Handler:
    return lambda _: push(value)
