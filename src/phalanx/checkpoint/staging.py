"""Host copies of a checkpoint's tensors, taken when ``save(async_=True)`` is called.

An asynchronous save writes after ``save`` returns, while training goes on changing its
parameters and optimizer state in place; so ``save`` first copies every tensor it will write
into a host *staging* buffer and the background write reads only those. A CUDA tensor is copied
into pinned memory (a non-blocking copy on the device's current stream; the writer waits for
an event recorded there after the copies), a CPU tensor into plain memory.

The buffers are kept and reused by the next save when a tensor's section, key, shape and dtype
match (as torch DCP's staging cache does): a job that saves every N steps allocates them once.
The next save waits for the previous write before it copies (``background.py``), so a buffer is
never overwritten while it is being written. The cost is one host copy of the saved state for
the life of the process (:func:`release` frees it).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from phalanx.checkpoint.sections import Section

__all__ = ["Staged", "release", "stage", "staged_bytes"]

_Key = tuple[str, str, bool]
_BUFFERS: dict[_Key, torch.Tensor] = {}


class Staged:
    """Sections whose tensors are host copies, and a wait for the copies to finish."""

    def __init__(self, sections: list[Section], events: list[torch.cuda.Event]) -> None:
        self.sections = sections
        self._events = events

    def ready(self) -> None:
        """Block until every device-to-host copy has landed (at once for CPU tensors)."""
        for event in self._events:
            event.synchronize()


def _copyable(t: torch.Tensor) -> bool:
    """Dense tensors; the others are left for ``format.encode`` to refuse, naming them."""
    return t.layout == torch.strided and not t.is_quantized and not t.is_meta


def _buffer(key: _Key, t: torch.Tensor, used: dict[_Key, torch.Tensor]) -> torch.Tensor:
    old = _BUFFERS.get(key)
    if old is not None and old.shape == t.shape and old.dtype == t.dtype:
        buf = old
    else:
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=key[2])
    used[key] = buf
    return buf


def stage(sections: list[Section]) -> Staged:
    """Copy the tensors of ``sections`` into (reused) host buffers; return the copied sections.

    The copies are taken now: changing the original tensors afterwards does not change what is
    written. Buffers of tensors that this save no longer has are dropped.
    """
    used: dict[_Key, torch.Tensor] = {}
    devices: set[torch.device] = set()
    out = []
    with torch.no_grad():
        for section in sections:
            tensors = {}
            for name, t in section.tensors.items():
                if not _copyable(t):
                    tensors[name] = t
                    continue
                pinned = t.device.type == "cuda"
                if pinned:
                    devices.add(t.device)
                buf = _buffer((section.name, name, pinned), t, used)
                tensors[name] = buf.copy_(t.detach(), non_blocking=pinned)
            out.append(replace(section, tensors=tensors))
    _BUFFERS.clear()
    _BUFFERS.update(used)
    events = []
    for device in devices:  # each copy ran on its device's current stream
        events.append(torch.cuda.Event())
        events[-1].record(torch.cuda.current_stream(device))
    return Staged(out, events)


def release() -> None:
    """Free the staging buffers (the next asynchronous save allocates new ones)."""
    _BUFFERS.clear()


def staged_bytes() -> int:
    """Bytes held in staging buffers now (for tests and reports)."""
    return sum(b.numel() * b.element_size() for b in _BUFFERS.values())
