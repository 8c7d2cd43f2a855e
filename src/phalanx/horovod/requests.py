"""Requests: one rank's side of an operation, what must agree across ranks, and the message
when it does not.

A :class:`Request` carries this rank's tensors and a ``start`` function that launches the
collective once the ranks have agreed (``controller.py``). Its :func:`describe` form is plain
data: it travels to the other ranks when the rows of a round do not suffice (a deferred request,
a joined rank that needs the shapes, a mismatch to explain). :func:`mismatch` compares the
descriptions in Horovod's order (operation, dtypes, shapes, root, reduction, scaling, device) and
names every rank's call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx._check import check_str, check_tensor
from phalanx.horovod.protocol import Kind, ReduceOp, stable_hash

__all__ = ["Agreement", "Request", "Start", "describe", "mismatch", "signature"]

Desc = dict[str, Any]


@dataclass(frozen=True)
class Agreement:
    """What a request learns from the others when it starts: their payloads, by set rank."""

    payloads: tuple[tuple[int, ...] | None, ...]
    """Each rank's payload (None for a joined rank that lacks the request)."""
    joined: tuple[int, ...] = ()
    """Process-set ranks taking part with neutral values."""


Start = Callable[["Request", Agreement], tuple[Sequence[Any], Callable[[], Any]]]
"""Launch the collective(s): returns the works and the step that produces the result."""


@dataclass(eq=False)
class Request:
    """This rank's side of one operation."""

    kind: Kind
    name: str | None
    """The user's name; None for an unnamed call (matched by call order)."""
    tensors: list[torch.Tensor]
    start: Start
    root: int = -1
    """Broadcast root (global rank)."""
    op: int = -1
    """Horovod reduce op (``hvd.Sum`` ...)."""
    pre: float = 1.0
    post: float = 1.0
    payload: tuple[int, ...] = ()
    """Per-rank integers the others need (allgather's first dimensions, alltoall's splits)."""
    free_first_dim: bool = False
    """Dimension 0 may differ across ranks (allgather, alltoall)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Local settings of ``start`` (in place, compression ...); never compared."""
    key: str = ""
    """``<kind>.<name>`` or ``<kind>.noname.<k>``: what ranks match on (set by the controller)."""
    key_hash: int = 0
    """``stable_hash(key)``, as rows carry it."""

    def __post_init__(self) -> None:
        where = f"hvd.{self.kind.name.lower()}"
        if self.name is not None:
            check_str("name", self.name, where=where)
        for i, t in enumerate(self.tensors):
            check_tensor("tensor" if len(self.tensors) == 1 else f"tensors[{i}]", t, where=where)


def _tensor_meta(t: torch.Tensor) -> list[Any]:
    return [str(t.dtype).removeprefix("torch."), list(t.shape), t.device.type]


def describe(req: Request) -> Desc:
    """Plain-data form of ``req`` (travels through phalanx's pickle-free object codec)."""
    tensors = [_tensor_meta(t) for t in req.tensors]
    return {
        "kind": int(req.kind),
        "key": req.key,
        "tensors": tensors,
        "root": req.root,
        "op": req.op,
        "pre": req.pre,
        "post": req.post,
        "payload": list(req.payload),
        "free": req.free_first_dim,
    }


def signature(desc: Desc) -> int:
    """Hash of everything that must be equal on every rank (not the name, not the payload)."""
    tensors = [[d, s[1:] if desc["free"] else s, len(s), dev] for d, s, dev in desc["tensors"]]
    fields = [desc["kind"], tensors, desc["root"], desc["op"], desc["pre"], desc["post"]]
    return stable_hash(json.dumps(fields))


def _shape(meta: list[Any], free: bool) -> str:
    dims = [str(d) for d in meta[1]]
    if free and dims:
        dims[0] = "*"
    return f"{meta[0]} [{', '.join(dims)}]"


def _op_name(op: int) -> str:
    return f"hvd.{ReduceOp(op).name}" if op in {o.value for o in ReduceOp} else str(op)


def _per_rank(descs: dict[int, Desc], show: Callable[[Desc], str]) -> str:
    return ", ".join(f"rank {r} {show(d)}" for r, d in descs.items())


def mismatch(descs: dict[int, Desc]) -> str | None:
    """Why the ranks' descriptions of one request disagree (None if they agree).

    Args:
        descs: ``{global rank: description}`` of every rank that issued the request.
    """
    checks: list[tuple[str, Callable[[Desc], Any], Callable[[Desc], str]]] = [
        ("operations", lambda d: d["kind"], lambda d: f"called {Kind(d['kind']).label}"),
        (
            "numbers of tensors",
            lambda d: len(d["tensors"]),
            lambda d: f"passed {len(d['tensors'])}",
        ),
        (
            "data types",
            lambda d: [m[0] for m in d["tensors"]],
            lambda d: f"sent {', '.join(m[0] for m in d['tensors'])}",
        ),
        (
            "tensor shapes",
            lambda d: [(len(m[1]), m[1][1:] if d["free"] else m[1]) for m in d["tensors"]],
            lambda d: f"sent {'; '.join(_shape(m, d['free']) for m in d['tensors'])}",
        ),
        ("root ranks", lambda d: d["root"], lambda d: f"named root {d['root']}"),
        ("reduction operations", lambda d: d["op"], lambda d: f"asked for op {_op_name(d['op'])}"),
        (
            "prescale/postscale factors",
            lambda d: (d["pre"], d["post"]),
            lambda d: f"scaled by ({d['pre']}, {d['post']})",
        ),
        (
            "devices",
            lambda d: [m[2] for m in d["tensors"]],
            lambda d: f"used {', '.join(m[2] for m in d['tensors'])}",
        ),
    ]
    for what, key, show in checks:
        if len({json.dumps(key(d)) for d in descs.values()}) > 1:
            return f"mismatched {what}: {_per_rank(descs, show)}"
    return None
