"""DataParallel: one process, one thread per device (``torch.nn.DataParallel``'s design, seed 002).

Each forward: scatter the inputs along ``dim`` to the devices, replicate the module onto them, run
the replicas in parallel threads, and gather the outputs on ``output_device``. Replication is
differentiable, so ``backward`` sums every replica's gradient into the ONE set of original
parameters; the optimizer then steps only those, and the next forward copies them out again.

* On the original's device (e.g. ``device_ids=["cpu", "cpu"]``) replicas use the original
  parameters, no copy: threads only read them in forward; the autograd engine sums the branches.
* On another device: a differentiable copy, one transfer per dtype (flattened first, like
  ``broadcast_coalesced``); its backward carries the gradient home.
* Buffers: replica 0 uses the originals, so its in-place updates (BatchNorm running statistics)
  persist; the other replicas update private copies, as in torch.

Replicas are shallow copies of every submodule (like ``torch.nn.parallel.replicate``) rather than
one module run through ``torch.func.functional_call``: functional_call swaps the parameters of the
shared module object in place, which is a data race when several threads run it at once.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from phalanx._check import (
    MODULE,
    check_device,
    check_int,
    checked,
    fail,
    part_of,
    rule,
)
from phalanx.data_parallel.scatter_gather import gather, num_chunks, scatter

__all__ = ["DataParallel"]

DeviceLike = int | str | torch.device
WHERE = "DataParallel"


def _as_device(value: Any, arg: str, where: str = WHERE) -> torch.device:
    """``0`` -> cuda:0, ``-1`` -> cpu (torch's gather convention), ``"cpu"``, ``torch.device``."""
    value = check_device(arg, value, where=where)
    if isinstance(value, int):
        if value < -1:
            raise fail(arg, value, "a CUDA index >= 0 (or -1 for CPU)", where=where)
        return torch.device("cpu") if value == -1 else torch.device("cuda", value)
    try:
        device = torch.device(value)
    except RuntimeError:
        raise fail(arg, value, "a device, e.g. 'cpu', 'cuda:1' or 1", where=where) from None
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _resolve_device_ids(device_ids: Sequence[DeviceLike] | None) -> list[torch.device]:
    if device_ids is None:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    what = "a list of devices, e.g. ['cpu', 'cpu'] or [0, 1]"
    if isinstance(device_ids, str | int | torch.device):
        raise fail("device_ids", device_ids, what, where=WHERE, error=TypeError)
    with part_of("device_ids", device_ids, WHERE):
        devices = [_as_device(d, f"device_ids[{i}]", "") for i, d in enumerate(device_ids)]
    if not devices:
        fix = "pass None for every visible GPU"
        raise fail("device_ids", device_ids, "a non-empty list", where=WHERE, fix=fix)
    return devices


# --- replicate -----------------------------------------------------------------------------------


def _copies_on(
    tensors: Sequence[torch.Tensor], devices: list[torch.device]
) -> list[list[torch.Tensor]]:
    """Differentiable copies of ``tensors`` on each device, one transfer per dtype and device."""
    copies: list[list[Any]] = [[None] * len(tensors) for _ in devices]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])  # autograd: grads split back
        sizes = [tensors[i].numel() for i in idx]
        for j, device in enumerate(devices):
            # copy=True: two replicas on one device must not share (and race on) one buffer
            for i, piece in zip(idx, flat.to(device, copy=True).split(sizes)):
                copies[j][i] = piece.view_as(tensors[i])
    return copies


def _tensors_for(
    source: Sequence[torch.Tensor], devices: list[torch.device], share: list[bool]
) -> list[dict[int, torch.Tensor]]:
    """Per replica: ``id(original) -> tensor``; the original itself where ``share[j]``."""
    others = [d for d, s in zip(devices, share) if not s]
    copied = iter(_copies_on(source, others))
    maps = []
    for s in share:
        values = source if s else next(copied)
        maps.append({id(t): v for t, v in zip(source, values)})
    return maps


def _shallow_copy(
    module: nn.Module, params: dict[int, Any], buffers: dict[int, Any], memo: dict[int, nn.Module]
) -> nn.Module:
    if id(module) in memo:  # a submodule used twice stays one module in the replica
        return memo[id(module)]
    replica = module._replicate_for_data_parallel()  # new object; own _parameters/_buffers dicts
    memo[id(module)] = replica
    for key, p in module._parameters.items():
        # Copies are not leaves, so they are plain attributes, not Parameters (as in torch).
        replica.__dict__[key] = None if p is None else params[id(p)]
    for key, b in module._buffers.items():
        replica._buffers[key] = None if b is None else buffers[id(b)]
    for key, child in module._modules.items():
        replica._modules[key] = (
            None if child is None else _shallow_copy(child, params, buffers, memo)
        )
    return replica


def _replicate(module: nn.Module, devices: list[torch.device]) -> list[nn.Module]:
    source = devices[0]
    params, buffers = list(module.parameters()), list(module.buffers())
    param_maps = _tensors_for(params, devices, [d == source for d in devices])
    with torch.no_grad():  # buffers carry no gradient; replica 0 keeps the originals
        buffer_maps = _tensors_for(buffers, devices, [j == 0 for j in range(len(devices))])
    return [_shallow_copy(module, p, b, {}) for p, b in zip(param_maps, buffer_maps)]


# --- parallel apply --------------------------------------------------------------------------


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The caller's autocast dtype for ``device``'s type, or None when autocast is off."""
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None
    return torch.get_autocast_dtype(device.type) if enabled else None


class _ThreadState:
    """The caller's thread-local state (grad mode, autocast, CUDA stream) for worker threads."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [_autocast_dtype(d) for d in devices]
        self.streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]

    @contextlib.contextmanager
    def enter(self, i: int, device: torch.device) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(self.streams[i]))
            if self.autocast[i] is not None:
                stack.enter_context(torch.autocast(device.type, dtype=self.autocast[i]))
            yield


def _replica_error(exc: BaseException, index: int, device: torch.device) -> BaseException:
    """The same exception type, its message naming the replica and device (else RuntimeError)."""
    message = f"{type(exc).__name__} in DataParallel replica {index} on device {device}: {exc}"
    try:
        return type(exc)(message)
    except Exception:
        return RuntimeError(message)


def _parallel_apply(
    replicas: list[nn.Module],
    args: list[Any],
    kwargs: list[Any],
    devices: list[torch.device],
) -> list[Any]:
    """Run replica ``i`` on ``args[i]`` in thread ``i`` (replica 0 in the calling thread)."""
    state = _ThreadState(devices)
    results: list[Any] = [None] * len(replicas)
    errors: dict[int, BaseException] = {}

    def work(i: int) -> None:
        try:
            with state.enter(i, devices[i]):
                results[i] = replicas[i](*args[i], **kwargs[i])
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors[i] = exc

    threads = [
        threading.Thread(target=work, args=(i,), name=f"phalanx-dp-replica-{i}", daemon=True)
        for i in range(1, len(replicas))
    ]
    for t in threads:
        t.start()
    work(0)
    for t in threads:
        t.join()
    if errors:
        first = min(errors)
        raise _replica_error(errors[first], first, devices[first]) from errors[first]
    return results


# --- the module --------------------------------------------------------------------------------


class DataParallel(nn.Module):
    """Split each batch across devices in one process, one thread per device.

    The drop-in for ``torch.nn.DataParallel``: ``model = DataParallel(model)``, then train as
    usual; ``model.module`` is the wrapped module and ``state_dict()`` keys start with
    ``module.``. Besides CUDA devices it accepts CPU device lists (``["cpu", "cpu"]``), which run
    the same code path for testing. For multi-process training prefer
    :class:`phalanx.DistributedDataParallel` (no GIL, no per-step parameter copies).

    Args:
        module: The module to parallelise; its parameters and buffers must be on
            ``device_ids[0]``.
        device_ids: Devices as CUDA indices, strings or ``torch.device``; ``None`` for every
            visible GPU, or, without a GPU, to run ``module`` directly (with a warning).
        output_device: Where outputs are gathered (``-1`` for CPU); default ``device_ids[0]``.
        dim: The batch dimension inputs are split along and outputs concatenated along.

    Raises:
        ValueError: ``device_ids`` empty or not devices, ``output_device`` not a device, ``dim``
            not an int (or, at forward time, out of range for an input or output).
    """

    @checked(
        module=MODULE,
        dim=rule(check_int, fix="the batch dimension"),
    )
    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
    ) -> None:
        super().__init__()
        self.module = module
        self.dim = dim
        self.device_ids = _resolve_device_ids(device_ids)
        self.output_device: torch.device | None = None
        if not self.device_ids:
            warnings.warn(
                "DataParallel(device_ids=None) found no CUDA device: running the module directly "
                "on one device (pass device_ids=['cpu', 'cpu'] to split batches on the CPU)",
                stacklevel=3,  # the user's call: __init__, its argument check
            )
        elif output_device is None:
            self.output_device = self.device_ids[0]
        else:
            self.output_device = _as_device(output_device, "output_device")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Scatter, run the replicas in parallel, gather on ``output_device``."""
        if not self.device_ids or self.output_device is None:
            return self.module(*args, **kwargs)
        self._check_module_device()
        n = num_chunks(args, kwargs, self.dim, len(self.device_ids))
        devices = self.device_ids[:n]
        scattered_args = scatter(args, devices, self.dim)
        scattered_kwargs = scatter(kwargs, devices, self.dim)
        if n == 1:  # nothing to parallelise: the module itself, output moved like a gather
            out = self.module(*scattered_args[0], **scattered_kwargs[0])
            return scatter(out, [self.output_device], 0)[0]  # a one-device scatter moves
        replicas = _replicate(self.module, devices)
        outputs = _parallel_apply(replicas, scattered_args, scattered_kwargs, devices)
        return gather(outputs, self.output_device, self.dim)

    def _check_module_device(self) -> None:
        source = self.device_ids[0]
        named = [*self.module.named_parameters(), *self.module.named_buffers()]
        for name, t in named:
            if t.device != source:
                raise ValueError(
                    f"DataParallel needs the module on device_ids[0]={source}, but {name} is on "
                    f"{t.device}; call module.to({str(source)!r}) first"
                )
