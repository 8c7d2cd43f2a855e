"""Collective fingerprints: what must agree across ranks, and how to say that it does not.

Pure functions over plain dicts, unit-tested without processes. The call site travels with the
fingerprint but is not one of the compared fields: sites are judged by the skipped-collective
rule of :mod:`.pairing`, which needs the next call too.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.diagnostics.flight import Record

__all__ = ["args_text", "as_record", "describe", "make", "mismatch", "mismatch_message"]

COMPARED = ("op", "reduce_op", "root", "dtype", "shape")


def _op_name(reduce_op: Any) -> str | None:
    return getattr(reduce_op, "name", None if reduce_op is None else str(reduce_op))


def args_text(reduce_op: Any, root: int | None) -> str:
    """``SUM``, ``root=0``, ``MAX root=1`` or "": the reduce op and root as records show them."""
    name = _op_name(reduce_op)
    if root is None:
        return name or ""
    return f"root={root}" if name is None else f"{name} root={root}"


def as_record(fp: dict[str, Any]) -> Record:
    """The fingerprint as a flight record (for :func:`.pairing.first_mismatch`)."""
    shape = "-"
    if fp.get("dtype") is not None:
        dims = "[*]" if fp.get("shape") is None else str(fp["shape"])
        shape = f"{dims} {fp['dtype']}"
    args = args_text(fp.get("reduce_op"), fp.get("root"))
    return Record(
        str(fp["group"]), int(fp["seq"]), str(fp["op"]), shape, str(fp["site"]), 0.0, args=args
    )


def make(
    op: str,
    group: str,
    seq: int,
    tensor: torch.Tensor | None,
    reduce_op: Any,
    root: int | None,
    compare_shape: bool,
    site: str,
) -> dict[str, Any]:
    """Build the fingerprint of one collective call on this rank."""
    return {
        "seq": seq,
        "group": group,
        "op": op,
        "reduce_op": _op_name(reduce_op),
        "root": root,
        "dtype": None if tensor is None else str(tensor.dtype).removeprefix("torch."),
        "shape": None if tensor is None or not compare_shape else list(tensor.shape),
        "site": site,
    }


def describe(fp: dict[str, Any]) -> str:
    """``all_reduce(shape=[4], dtype=float32, op=SUM)``: the call as a reader would write it."""
    args = []
    if fp.get("shape") is not None:
        args.append(f"shape={fp['shape']}")
    if fp.get("dtype") is not None:
        args.append(f"dtype={fp['dtype']}")
    if fp.get("reduce_op") is not None:
        args.append(f"op={fp['reduce_op']}")
    if fp.get("root") is not None:
        args.append(f"root={fp['root']}")
    return f"{fp['op']}({', '.join(args)})"


def _key(fp: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(str(fp.get(f)) for f in COMPARED)


def mismatch(seen: dict[int, dict[str, Any]]) -> bool:
    """True when the fingerprints published so far disagree on any compared field."""
    return len({_key(fp) for fp in seen.values()}) > 1


def _differing_fields(seen: dict[int, dict[str, Any]]) -> list[str]:
    return [f for f in COMPARED if len({str(fp.get(f)) for fp in seen.values()}) > 1]


def mismatch_message(rank: int, group: str, seq: int, seen: dict[int, dict[str, Any]]) -> str:
    """The error every rank raises: who called what, where, and what differs."""
    by_call: dict[tuple[Any, ...], list[int]] = {}
    for r, fp in sorted(seen.items()):
        by_call.setdefault(_key(fp), []).append(r)
    lines = [f"[rank {rank}] collective #{seq} on group {group} does not match across ranks:"]
    for ranks in by_call.values():
        fp = seen[ranks[0]]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        lines.append(f"  {who}: {describe(fp)} at {fp['site']}")
    fields = _differing_fields(seen)
    lines.append(f"  differing: {', '.join(fields)}.")
    if "op" in fields:
        lines.append(
            "  Ranks issue collectives in a different order: a rank skipped one or called an "
            "extra one (rank-dependent control flow such as `if rank == 0:` around a collective)."
        )
    else:
        lines.append(
            "  Every rank must pass tensors of the same shape and dtype, and the same reduce op "
            "and root, to the same collective."
        )
    return "\n".join(lines)
