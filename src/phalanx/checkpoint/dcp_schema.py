"""What a DCP ``.metadata`` file may hold: its record classes, the globals it may name, the type
of every field, and the few calls it makes.

torch's ``FileSystemReader`` pickles a :class:`~torch.distributed.checkpoint.metadata.Metadata`
of DCP's own dataclasses. :mod:`~phalanx.checkpoint.dcp_pickle` builds them from the file as
data, asking this module at each step:

- :func:`resolve`: a global the file names becomes an inert :class:`Global` token (or, for a
  dtype, the dtype): only :data:`GLOBALS` resolve, and never to the object they name.
- :func:`fields_of`: the fields a ``BUILD`` state gives a record of :data:`RECORDS`, each value
  checked against the field's type (a finished record, a ``torch.Size``, a dict of strings...),
  missing fields taking the dataclass default; ``TensorProperties`` from the 5-tuple its
  ``__getstate__`` writes.
- :func:`call`: what ``REDUCE`` of an allowed callable gives, computed here on checked
  arguments: ``torch.Size`` of at most :data:`~phalanx.checkpoint.limits.MAX_DIMS` int64s, a
  layout by name from torch's own table, a memory-format code, a ``pathlib`` path of strings
  (built as a pure path), an empty ``OrderedDict`` (built as a dict).

Every refusal raises :class:`~phalanx._pickle_machine.Refused` with a message that shows
types and sizes (:func:`brief`), never the ``repr`` of a container from the file.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from phalanx import _pickle_machine
from phalanx._pickle_machine import Refused
from phalanx.checkpoint.limits import shape_ok

__all__ = [
    "CALLS",
    "GLOBALS",
    "RECORDS",
    "Fresh",
    "Global",
    "brief",
    "call",
    "fields_of",
    "has_fields",
    "path_key",
    "refuse",
    "resolve",
]

_META = "torch.distributed.checkpoint.metadata"
RECORDS: dict[tuple[str, str], type] = {
    (_META, "Metadata"): md.Metadata,
    (_META, "MetadataIndex"): md.MetadataIndex,
    (_META, "StorageMeta"): md.StorageMeta,
    (_META, "TensorProperties"): md.TensorProperties,
    (_META, "TensorStorageMetadata"): md.TensorStorageMetadata,
    (_META, "BytesStorageMetadata"): md.BytesStorageMetadata,
    (_META, "ChunkStorageMetadata"): md.ChunkStorageMetadata,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
}
"""DCP's record classes: the only ones ``NEWOBJ`` creates and ``BUILD`` fills."""
_PATHS = {
    "PosixPath": pathlib.PurePosixPath,
    "PurePosixPath": pathlib.PurePosixPath,
    "WindowsPath": pathlib.PureWindowsPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}
CALLS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        (_META, "_MEM_FORMAT_ENCODING"),
        ("collections", "OrderedDict"),
        *(("pathlib", name) for name in _PATHS),
    }
)
"""The callables ``REDUCE`` may name (module, name): :func:`call` does their work."""
GLOBALS: frozenset[tuple[str, str]] = frozenset({*RECORDS, *CALLS})
"""Every global a ``.metadata`` file may name (module, name), besides torch's dtypes."""
_ENCODING = md._MEM_FORMAT_ENCODING
_MEMORY_FORMATS = {
    _ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
    _ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
    _ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format,
}


def refuse(why: str) -> NoReturn:
    raise Refused(why)


@dataclasses.dataclass(frozen=True)
class Global:
    """A global the file named: a token, never the object itself."""

    module: str
    name: str

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


@dataclasses.dataclass(frozen=True)
class Fresh:
    """A record ``NEWOBJ`` created and ``BUILD`` has not filled yet: no field check accepts it."""

    cls: type


def brief(value: object) -> str:
    """What ``value`` is, in a few words: bounded whatever the file holds."""
    if isinstance(value, Global):
        return str(value)
    if isinstance(value, torch.dtype):
        return repr(value)
    if isinstance(value, Fresh):
        return f"a {value.cls.__name__} not yet built"
    return _pickle_machine.brief(value)


def resolve(module: str, name: str) -> object:
    """The token (or, for a dtype, the dtype) for a global the file names."""
    if (module, name) in GLOBALS:
        return Global(module, name)
    dtype = vars(torch).get(name) if module == "torch" else None
    if isinstance(dtype, torch.dtype):
        return dtype
    refuse(f"global {module}.{name} is not part of DCP's metadata")


# ---- field checks: each returns whether a value fits the field's type ----------------------

_Check = Callable[[Any], bool]


def _int(v: object) -> bool:
    return type(v) is int


def _str(v: object) -> bool:
    return type(v) is str


def _optional(check: _Check) -> _Check:
    return lambda v: v is None or check(v)


def _size(v: object) -> bool:
    return type(v) is torch.Size


def _record(cls: type) -> _Check:
    """A finished record of ``cls`` (an unbuilt one is a :class:`Fresh`, never a ``cls``)."""
    return lambda v: type(v) is cls


def _dict_of(key: _Check, value: _Check) -> _Check:
    return lambda v: type(v) is dict and all(key(k) and value(x) for k, x in v.items())


def _list_of(item: _Check) -> _Check:
    return lambda v: type(v) is list and all(map(item, v))


def path_key(v: object) -> bool:
    """A step of an object path (``planner_data``): a string or an int."""
    return _str(v) or _int(v)


_FIELDS: dict[type, dict[str, _Check]] = {
    md.Metadata: {
        "state_dict_metadata": _dict_of(
            _str, lambda v: type(v) in (md.TensorStorageMetadata, md.BytesStorageMetadata)
        ),
        "planner_data": _optional(
            _dict_of(_str, lambda v: type(v) is tuple and all(map(path_key, v)))
        ),
        "storage_data": _optional(_dict_of(_record(md.MetadataIndex), _record(_StorageInfo))),
        "storage_meta": _optional(_record(md.StorageMeta)),
        "version": _optional(_str),
    },
    md.TensorStorageMetadata: {
        "properties": _record(md.TensorProperties),
        "size": _size,
        "chunks": _list_of(_record(md.ChunkStorageMetadata)),
    },
    md.TensorProperties: {  # built from a 5-tuple (_properties), checked as these say
        "dtype": lambda v: isinstance(v, torch.dtype),
        "layout": lambda v: isinstance(v, torch.layout),
        "requires_grad": lambda v: type(v) is bool,
        "memory_format": lambda v: v in _MEMORY_FORMATS.values(),
        "pin_memory": lambda v: type(v) is bool,
    },
    md.BytesStorageMetadata: {},
    md.ChunkStorageMetadata: {"offsets": _size, "sizes": _size},
    md.MetadataIndex: {"fqn": _str, "offset": _optional(_size), "index": _optional(_int)},
    _StorageInfo: {
        "relative_path": _str,
        "offset": _int,
        "length": _int,
        "transform_descriptors": _optional(
            lambda v: type(v) in (list, tuple) and all(map(_str, v))
        ),
    },
    md.StorageMeta: {
        "checkpoint_id": _optional(lambda v: _str(v) or isinstance(v, pathlib.PurePath)),
        "save_id": _optional(_str),
        "load_id": _optional(_str),
        "modules": _list_of(_str),
    },
}
"""Each record class -> its fields -> the check of a value from the file."""


def has_fields(cls: type) -> bool:
    """Whether a record of ``cls`` takes its fields from a ``BUILD`` (all but one do)."""
    return bool(_FIELDS[cls])


def _default(cls: type, name: str) -> object:
    """The dataclass default of ``cls.name`` (torch's own factory, not the file's)."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    refuse(f"a {cls.__name__} without its field {name!r}")


def fields_of(cls: type, state: object) -> dict[str, object]:
    """The checked field values ``state`` gives a fresh ``cls``."""
    if cls is md.TensorProperties:
        return _properties(state)
    checks = _FIELDS[cls]
    if state is None:
        state = {}
    if type(state) is not dict:
        refuse(f"the state of a {cls.__name__} is {brief(state)}, not a dict of its fields")
    unknown = [k for k in state if k not in checks]
    if unknown:
        refuse(f"{brief(unknown[0])} is not a field of {cls.__name__}")
    for name, value in state.items():
        if not checks[name](value):
            refuse(f"field {cls.__name__}.{name} holds {brief(value)}, not its type")
    return {name: state[name] if name in state else _default(cls, name) for name in checks}


def _properties(state: object) -> dict[str, object]:
    """TensorProperties' fields from the 5-tuple its ``__getstate__`` writes."""
    if type(state) is not tuple or len(state) != 5:
        refuse(f"the state of a TensorProperties is {brief(state)}, not its 5-tuple")
    dtype, layout, grad, memory, pinned = state
    fields = dict(dtype=dtype, layout=layout, requires_grad=grad, pin_memory=pinned)
    fields["memory_format"] = _MEMORY_FORMATS.get(memory) if type(memory) is _ENCODING else None
    for name, check in _FIELDS[md.TensorProperties].items():
        if not check(fields[name]):
            refuse(f"field TensorProperties.{name} holds {brief(fields[name])}, not its type")
    return fields


# ---- the calls REDUCE may make: this module's own code on checked arguments ----------------


@functools.cache
def _layouts() -> dict[str, torch.layout]:
    """torch's layouts by name, as ``torch.serialization._get_layout`` finds them."""
    return {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def call(fn: Global, args: object) -> object:
    """What ``fn(*args)`` gives, for ``fn`` in :data:`CALLS`, computed here."""
    if type(args) is not tuple:
        refuse(f"{fn} called with {brief(args)}, not a tuple")
    key = (fn.module, fn.name)
    if key == ("torch", "Size") and len(args) == 1 and type(args[0]) is tuple:
        dims = list(args[0])
        if shape_ok(dims):
            return torch.Size(dims)
        refuse(f"a torch.Size of {brief(args[0])} that are not {len(dims)} int64 >= 0")
    if key == ("torch.serialization", "_get_layout") and len(args) == 1:
        layout = _layouts().get(args[0]) if _str(args[0]) else None
        if layout is not None:
            return layout
    if key == (_META, "_MEM_FORMAT_ENCODING") and len(args) == 1 and _int(args[0]):
        for member in _MEMORY_FORMATS:
            if member.value == args[0]:
                return member
    if key == ("collections", "OrderedDict") and not args:
        return {}
    if fn.module == "pathlib" and all(map(_str, args)):
        return _PATHS[fn.name](*args)
    refuse(f"{fn} called with {brief(args)}" + (f" ({brief(args[0])})" if args else ""))
