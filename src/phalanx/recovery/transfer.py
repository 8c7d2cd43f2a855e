"""Hand the training state from a live member to a generation's newcomers, bit-exact.

A state is a tree of dicts, lists and tuples whose leaves are tensors and JSON scalars (str,
int, float, bool, None), e.g. ``{"model": model.state_dict(), "optim": opt.state_dict(),
"step": 120, "rng": rng_state()}``. The sender encodes the tree as tagged JSON (dict keys keep
their types, so an optimizer's integer parameter ids survive; tuples stay tuples) and packs the
bytes of every tensor into one buffer, so a state of any number of tensors costs three sends
per receiver: a header, the JSON, the buffer. Tensors travel as raw bytes, never as values,
so every dtype arrives bit-identical (NaN payloads and signed zeros included). Received tensors
are fresh CPU tensors (or on ``device``); ``load_state_dict`` copies them where they belong.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx.recovery.errors import RecoveryError
from phalanx.recovery.live_group import LiveGroup

__all__ = ["receive_state", "rng_state", "send_state", "set_rng_state", "share_state"]

ALIGN = 16  # every tensor starts at a multiple of its element size in the buffer


def _encode(value: object, tensors: list[torch.Tensor], path: str) -> object:
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized:
            raise TypeError(
                f"share_state: {path} is a {value.layout} tensor; only dense ones travel"
            )
        tensors.append(value)
        return {"t": len(tensors) - 1}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        for key in value:
            if key is not None and not isinstance(key, bool | int | float | str):
                raise TypeError(
                    f"share_state: {path} has a key of type {type(key).__name__}: {key!r}"
                )
        return {"d": [[k, _encode(v, tensors, f"{path}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        items = [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
        return {"u" if isinstance(value, tuple) else "l": items}
    raise TypeError(
        f"share_state: {path} is a {type(value).__name__}; a state holds only tensors, dicts, "
        f"lists, tuples, str, int, float, bool and None (convert it, e.g. with .tolist())"
    )


def _decode(value: Any, tensors: list[torch.Tensor]) -> object:
    if not isinstance(value, dict):
        return value
    ((tag, body),) = value.items()
    if tag == "t":
        return tensors[body]
    if tag == "d":
        return {k: _decode(v, tensors) for k, v in body}
    items = [_decode(v, tensors) for v in body]
    return tuple(items) if tag == "u" else items


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[dict[str, Any]], int]:
    metas, offset = [], 0
    for t in tensors:
        offset = -(-offset // ALIGN) * ALIGN
        nbytes = t.numel() * t.element_size()
        metas.append(
            {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "at": offset}
        )
        offset += nbytes
    return metas, offset


def _pack(
    tensors: Sequence[torch.Tensor], metas: list[dict[str, Any]], size: int, device: torch.device
) -> torch.Tensor:
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    for t, meta in zip(tensors, metas):
        raw = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        buffer[meta["at"] : meta["at"] + raw.numel()].copy_(raw)
    return buffer


def _unpack(buffer: torch.Tensor, metas: list[dict[str, Any]]) -> list[torch.Tensor]:
    out = []
    for meta in metas:
        dtype = getattr(torch, meta["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"share_state: the sender named an unknown dtype {meta['dtype']!r}")
        count = 1
        for n in meta["shape"]:
            count *= n
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        raw = buffer[meta["at"] : meta["at"] + nbytes].clone()
        out.append(raw.view(dtype).reshape(meta["shape"]))
    return out


def send_state(
    state: Mapping[str, object],
    to: Sequence[int],
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> None:
    """Send ``state`` to the ranks ``to`` of ``group`` (each calls :func:`receive_state`)."""
    tensors: list[torch.Tensor] = []
    tree = _encode(dict(state), tensors, "state")
    metas, size = _layout(tensors)
    text = json.dumps({"tree": tree, "tensors": metas}).encode()
    dev = torch.device(device)
    header = torch.tensor([len(text), size], dtype=torch.int64, device=dev)
    manifest = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(dev)
    buffer = _pack(tensors, metas, size, dev)
    parts = (header, manifest, buffer) if size else (header, manifest)  # gloo: no empty sends
    for dst in to:
        for part in parts:
            dist.send(part, group=group, group_dst=dst)


def receive_state(
    src: int, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"
) -> dict[str, object]:
    """Receive the state that rank ``src`` of ``group`` sends with :func:`send_state`."""
    dev = torch.device(device)
    header = torch.empty(2, dtype=torch.int64, device=dev)
    dist.recv(header, group=group, group_src=src)
    manifest = torch.empty(int(header[0]), dtype=torch.uint8, device=dev)
    dist.recv(manifest, group=group, group_src=src)
    buffer = torch.empty(int(header[1]), dtype=torch.uint8, device=dev)
    if buffer.numel():
        dist.recv(buffer, group=group, group_src=src)
    decoded = json.loads(bytes(manifest.cpu().numpy()).decode())
    result = _decode(decoded["tree"], _unpack(buffer, decoded["tensors"]))
    assert isinstance(result, dict)
    return result


def share_state(live: LiveGroup, state: Mapping[str, object] | None) -> dict[str, object]:
    """After a generation with newcomers: the source sends its ``state``, newcomers receive it.

    Call it on every member right after :meth:`LiveGroup.admit` returned True (and after the
    constructor, on a replacement, whose own ``state`` is ignored and may be None). Members
    that neither send nor receive get ``state`` back unchanged.

    Raises:
        RecoveryError: no member of the generation holds the state (all were lost at once).
        ValueError: the source passed ``state=None``.
    """
    fresh = live.newcomers
    if not fresh:
        return dict(state or {})
    src = live.source
    if src is None:
        raise RecoveryError(
            f"share_state: rank {live.rank} (member {live.me}, generation {live.generation}): "
            f"no member holds the training state; restore it from the newest checkpoint"
        )
    if live.rank == src:
        if state is None:
            raise ValueError(
                f"share_state: rank {src} is the source of generation {live.generation} "
                f"and got state=None; pass the training state"
            )
        send_state(state, fresh)
        return dict(state)
    if live.rank in fresh:
        received = receive_state(src)
        live.state_received()
        return received
    return dict(state or {})


def rng_state() -> dict[str, object]:
    """This process's random generators: Python's, torch's CPU (and CUDA), numpy's if loaded."""
    state: dict[str, object] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    return state


def set_rng_state(state: Mapping[str, object]) -> None:
    """Restore the generators saved by :func:`rng_state` (received with the training state)."""
    random.setstate(state["python"])  # type: ignore[arg-type]
    torch.set_rng_state(state["torch"])  # type: ignore[arg-type]
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])  # type: ignore[arg-type]
    if "numpy" in state:
        import numpy

        saved = state["numpy"]
        assert isinstance(saved, list | tuple) and len(saved) == 5, "not an rng_state() value"
        name, keys, pos, has_gauss, cached = saved
        numpy.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
