"""Unpickling DCP's ``.metadata`` as data: the plain-data pickle machine, plus DCP's records.

torch's ``FileSystemReader`` reads ``.metadata`` with ``pickle.load``. Restricting the globals a
``pickle.Unpickler`` resolves (``find_class``) is not enough: ``BUILD`` is ``setattr`` (or
``__setstate__``) on whatever object is on the stack, so a file that names only allowed globals
can still set ``PosixPath.__fspath__`` or a function's attribute and rewire the process that
reads it; and a few hundred bytes of shared references (each level of a list holding the
previous level twice) make a structure of 2**40 elements that hangs whoever hashes, walks or
``repr``s it.

:func:`loads_metadata` runs :class:`~phalanx._pickle_machine.PlainMachine` (plain values,
bounded depth, stack and expanded size, hash-bounded keys) with the opcodes that
``torch.distributed.checkpoint`` writes (protocols 2 to 5) besides plain data, each asking
:mod:`~phalanx.checkpoint.dcp_schema` what is allowed:

- **Globals** (``GLOBAL``, ``STACK_GLOBAL``) become inert tokens, never the object they name;
  nothing the file names is ever on the stack to be set, built or called.
- **Records** (``NEWOBJ`` of one of DCP's record classes, with no arguments) are created with
  ``object.__new__``: no ``__init__``, no ``__post_init__``. ``BUILD`` applies to such a fresh
  record once, its state checked field by field and set with ``object.__setattr__``; no
  ``__setstate__`` runs.
- **Calls** (``REDUCE``) only where the schema itself does the work on checked arguments.

Stricter than plain data: the expanded size of a value is bounded by the file's bytes (not a
multiple), at most 20,000 values stand on the stack, a memo reference goes only to a value that
cannot change (DCP shares strings, globals and sizes, never a list, dict or record), and a dict
key is a string, an int or a finished ``MetadataIndex``. Sets, bytes and ``DUP`` (which DCP never
writes) are refused with ``INST``, ``OBJ``, ``PERSID``, ``EXT*`` and buffers; every refusal is a
:class:`~phalanx.checkpoint.errors.CheckpointError` naming the file and the byte offset.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import metadata as md

from phalanx._pickle_machine import Malformed, PlainMachine, Refused, hash_bounded
from phalanx.checkpoint import dcp_schema as schema
from phalanx.checkpoint.dcp_schema import Fresh, Global, refuse
from phalanx.checkpoint.errors import CheckpointError
from phalanx.checkpoint.limits import MAX_DEPTH

__all__ = ["loads_metadata"]

_NOT_WRITTEN = frozenset({"DUP", "EMPTY_SET", "ADDITEMS", "FROZENSET"})
_NOT_WRITTEN |= {"BINBYTES", "SHORT_BINBYTES", "BINBYTES8"}
"""Plain-data opcodes that DCP's metadata never holds: refused as any unknown opcode is."""
_UNSHARED = frozenset({list, dict, Fresh, *schema.RECORDS.values()})
"""What DCP never references twice; shared, these could change after being counted."""


class _MetadataMachine(PlainMachine):
    """The plain-data machine with DCP's globals, records and calls; see the module docstring."""

    max_depth = MAX_DEPTH
    max_stack = 20_000
    """Pickle adds a container's items in batches of 1000 (2000 stack entries for a dict), so
    DCP's files keep about 2000 there (measured)."""
    expansion = 1
    """No value larger, counting every shared reference in full, than the file has bytes."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        for name in _NOT_WRITTEN:
            del self.ops[name]
        self.ops |= {
            "GLOBAL": lambda arg: self.push(schema.resolve(*str(arg).partition(" ")[::2])),
            "STACK_GLOBAL": self.stack_global,
            "NEWOBJ": lambda _: self.new({}),
            "NEWOBJ_EX": lambda _: self.new(self.pop()),
            "REDUCE": self.reduce,
            "BUILD": self.build,
        }

    def share(self, value: object) -> object:
        if type(value) in _UNSHARED:
            refuse(f"a second reference to {schema.brief(value)}, which DCP never shares")
        return value

    def key_ok(self, key: object) -> bool:
        # an index record's hash is its string's (cached) and a torch.Size's of <= 64 dims
        kind = type(key)
        return kind is str or kind is md.MetadataIndex or (kind is int and hash_bounded(key))

    def describe(self, value: object) -> str:
        return schema.brief(value)

    def unknown(self, name: str) -> str:
        return f"opcode {name} is not one DCP's metadata uses"

    def stack_global(self, _: object) -> None:
        qualname, module = self.pop(), self.pop()
        if type(module) is not str or type(qualname) is not str:
            refuse("STACK_GLOBAL of something other than two strings")
        self.push(schema.resolve(module, qualname))

    def new(self, kwargs: object) -> None:
        """NEWOBJ(_EX): a fresh record of a class in RECORDS, with no arguments."""
        args, cls = self.pop(), self.pop()
        record = schema.RECORDS.get((cls.module, cls.name)) if type(cls) is Global else None
        if record is None or args != () or kwargs != {}:
            refuse(f"NEWOBJ of {schema.brief(cls)}: only DCP's record classes, with no arguments")
        if schema.has_fields(record):
            self.push(Fresh(record))  # BUILD makes the record, with its checked fields
        else:  # BytesStorageMetadata: no fields, no BUILD
            self.push(self.track(object.__new__(record), ()))

    def reduce(self, _: object) -> None:
        args, fn = self.pop(), self.pop()
        if type(fn) is not Global or (fn.module, fn.name) not in schema.CALLS:
            refuse(f"REDUCE calls {schema.brief(fn)}, which is not a call DCP's metadata makes")
        value = schema.call(fn, args)
        if type(value) is torch.Size or type(value) is dict:  # new: it weighs what it holds
            value = self.track(value, value)
        self.push(value)

    def build(self, _: object) -> None:
        state, fresh = self.pop(), self.pop()
        if type(fresh) is not Fresh:
            refuse(f"BUILD on {schema.brief(fresh)}: only on a new DCP record, once")
        record: object = object.__new__(fresh.cls)  # no __init__: the fields come from the state
        for name, value in schema.fields_of(fresh.cls, state).items():
            object.__setattr__(record, name, value)  # frozen records (MetadataIndex) too
        self.push(self.track(record, (state,)))


def loads_metadata(raw: bytes, source: str) -> md.Metadata:
    """The DCP ``Metadata`` pickled in ``raw``, built as data (see the module docstring).

    Raises:
        CheckpointError: naming ``source`` and the offending byte, for anything else.
    """
    try:
        meta = _MetadataMachine(len(raw)).run(raw)
        if type(meta) is not md.Metadata:
            refuse(f"it holds {schema.brief(meta)}, not DCP Metadata")
    except Refused as exc:
        why = f"malformed pickle: {exc}" if isinstance(exc, Malformed) else str(exc)
        raise CheckpointError(
            f"{source}: not a DCP metadata file, refusing it: {why}; only DCP's own records "
            "and plain values are read from it"
        ) from None
    return meta
