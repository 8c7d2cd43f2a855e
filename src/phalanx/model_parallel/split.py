"""Split a chain of layers over several devices driven by one process (seed 001 §4).

Inter-layer model parallelism for a model too large for one device: the first layers live on
the first device, their output is copied to the next device, and so on. Backward needs nothing
special: ``Tensor.to`` is differentiable, so autograd copies each gradient back across the same
boundary. Each optimizer update is local to the device holding the parameter.

Only one device computes at a time (no micro-batching); overlapping them is pipeline
parallelism (GPipe, Huang et al. 2019), a separate strategy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from phalanx.model_parallel._balance import balance_by_cost

__all__ = ["SplitModule", "split_across_devices"]

Device = torch.device | str


class SplitModule(nn.Module):
    """Consecutive ``nn.Sequential`` parts, part ``i`` on ``devices[i]``, run in order.

    ``forward(x)`` moves ``x`` (a tensor, or a tuple/list/dict of tensors) to each part's device
    before running that part and returns the output on :attr:`output_device`. Wrap it in
    ``phalanx.DistributedDataParallel(model)`` (``device_ids=None``) to combine with data
    parallelism: one process drives several devices, gradients are bucketed per device.

    Attributes:
        parts: The parts, an ``nn.ModuleList`` of ``nn.Sequential``.
        devices: The device of each part.
        balance: The number of layers in each part.
    """

    def __init__(self, parts: Sequence[nn.Sequential], devices: Sequence[Device]) -> None:
        """Move ``parts[i]`` to ``devices[i]`` (in place) and chain them.

        Raises:
            TypeError: a part is not an ``nn.Sequential``.
            ValueError: ``parts`` and ``devices`` differ in length, or a parameter is shared
                by parts on different devices.
        """
        super().__init__()
        devs = _as_devices(devices)
        if len(parts) != len(devs) or not parts:
            raise ValueError(
                f"need one device per part and at least one part, got {len(parts)} part(s) "
                f"and devices={[str(d) for d in devs]}"
            )
        for i, part in enumerate(parts):
            if not isinstance(part, nn.Sequential):
                raise TypeError(f"parts[{i}] must be an nn.Sequential, got {type(part).__name__}")
        _check_not_shared(parts, devs)
        self.parts = nn.ModuleList(part.to(d) for part, d in zip(parts, devs))
        self.devices: tuple[torch.device, ...] = devs
        self.balance: tuple[int, ...] = tuple(len(p) for p in parts)

    @property
    def output_device(self) -> torch.device:
        """The device of the last part, where :meth:`forward` returns its output."""
        return self.devices[-1]

    def forward(self, x: Any) -> Any:
        """Run the parts in order, copying the activations to each part's device first."""
        for part, device in zip(self.parts, self.devices):
            x = part(_to_device(x, device))
        return x

    def ranges(self) -> list[tuple[int, int]]:
        """The ``[start, stop)`` layer indices held by each part."""
        out, start = [], 0
        for count in self.balance:
            out.append((start, start + count))
            start += count
        return out

    def describe(self) -> str:
        """A table of the parts: device, layer range and names, parameter count and share."""
        counts = [sum(p.numel() for p in part.parameters()) for part in self.parts]
        total = sum(counts)
        lines = [
            f"SplitModule: {sum(self.balance)} layers, {total:,} parameters, "
            f"{len(self.parts)} devices"
        ]
        for i, (part, (a, b), n) in enumerate(zip(self.parts, self.ranges(), counts)):
            names = list(part._modules)
            share = 100.0 * n / total if total else 0.0
            lines.append(
                f"  part {i} on {self.devices[i]}: layers {a}-{b - 1} "
                f"[{names[0]} .. {names[-1]}], {n:,} parameters ({share:.1f}%)"
            )
        return "\n".join(lines)

    def extra_repr(self) -> str:
        """Devices and balance, shown by ``repr`` above the parts."""
        return f"devices={[str(d) for d in self.devices]}, balance={list(self.balance)}"


def split_across_devices(
    model: nn.Sequential | Sequence[nn.Module],
    devices: Sequence[Device],
    balance: Sequence[int] | None = None,
) -> SplitModule:
    """Cut a chain of layers into contiguous parts, one per device; the layers move in place.

    Seed 001's ``ModelParallelResNet50`` (``seq1`` = conv1, bn1, relu, maxpool, layer1, layer2
    on cuda:0; ``seq2`` = layer3, layer4, avgpool, then ``fc`` on cuda:1, copying ``seq1``'s
    output across by hand) is, with ``r = torchvision.models.resnet50()``::

        layers = [r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2,
                  r.layer3, r.layer4, r.avgpool, nn.Flatten(), r.fc]
        model = split_across_devices(layers, ["cuda:0", "cuda:1"], balance=[6, 5])
        loss = loss_fn(model(inputs), labels.to(model.output_device))

    Args:
        model: An ``nn.Sequential`` (child names are kept) or a list of modules; each layer
            takes the previous layer's output.
        devices: One device per part, e.g. ``["cuda:0", "cuda:1"]`` (``["cpu", "cpu"]`` works
            too, for tests). The same device may appear more than once.
        balance: Layers per device. ``None`` balances parameter counts: contiguous parts
            minimising the largest part (the one that must fit in its device's memory).

    Returns:
        A :class:`SplitModule` sharing the layers of ``model``.

    Raises:
        TypeError: ``model``, ``devices`` or ``balance`` is of the wrong kind.
        ValueError: more devices than layers, or a ``balance`` that does not fit the model.
    """
    layers = _named_layers(model)
    devs = _as_devices(devices)
    if len(devs) > len(layers):
        raise ValueError(
            f"{len(devs)} devices {[str(d) for d in devs]} but the model has only "
            f"{len(layers)} layer(s): every device needs at least one layer"
        )
    if balance is None:
        costs = [sum(p.numel() for p in layer.parameters()) for _, layer in layers]
        counts = balance_by_cost(costs, len(devs))
    else:
        counts = _checked_balance(balance, len(layers), len(devs))
    parts, start = [], 0
    for count in counts:
        parts.append(nn.Sequential(OrderedDict(layers[start : start + count])))
        start += count
    return SplitModule(parts, devs)


def _named_layers(model: Any) -> list[tuple[str, nn.Module]]:
    if isinstance(model, nn.Sequential):
        # _modules, not named_children(): that drops a layer repeated in the chain.
        layers = [(name, m) for name, m in model._modules.items() if m is not None]
    elif isinstance(model, (list, tuple, nn.ModuleList)):
        layers = [(str(i), m) for i, m in enumerate(model)]
    else:
        raise TypeError(
            f"model must be an nn.Sequential or a list of modules, got {type(model).__name__}"
        )
    for name, m in layers:
        if not isinstance(m, nn.Module):
            raise TypeError(f"model layer {name} must be an nn.Module, got {type(m).__name__}")
    if not layers:
        raise ValueError("model has no layers to split")
    return layers


def _as_devices(devices: Any) -> tuple[torch.device, ...]:
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, (list, tuple)):
        raise TypeError(f"devices must be a list of devices, e.g. ['cpu', 'cpu'], got {devices!r}")
    if not devices:
        raise ValueError("devices must name at least one device, got []")
    try:
        return tuple(torch.device(d) for d in devices)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"devices={devices!r}: {exc}") from exc


def _checked_balance(balance: Any, n_layers: int, n_devices: int) -> list[int]:
    if not isinstance(balance, (list, tuple)):
        raise TypeError(f"balance must be a list of layer counts, got {balance!r}")
    if any(isinstance(b, bool) or not isinstance(b, int) for b in balance):
        raise TypeError(f"balance must hold ints, got {list(balance)}")
    if len(balance) != n_devices:
        raise ValueError(
            f"balance={list(balance)} has {len(balance)} entries but there are {n_devices} devices"
        )
    if min(balance) < 1:
        raise ValueError(f"balance={list(balance)}: every device needs at least 1 layer")
    if sum(balance) != n_layers:
        raise ValueError(
            f"balance={list(balance)} sums to {sum(balance)} but the model has {n_layers} layers"
        )
    return list(balance)


def _check_not_shared(parts: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
    """A tied parameter can live on one device only: moving the second part would steal it."""
    owner: dict[int, tuple[int, str]] = {}
    for i, part in enumerate(parts):
        for name, p in part.named_parameters(remove_duplicate=True):
            first = owner.setdefault(id(p), (i, name))
            if first[0] != i and devices[first[0]] != devices[i]:
                raise ValueError(
                    f"parameter {name!r} of part {i} ({devices[i]}) is also {first[1]!r} of "
                    f"part {first[0]} ({devices[first[0]]}): shared parameters must stay on one "
                    f"device; choose a balance that keeps the layers sharing it together"
                )


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=_can_overlap(obj, device))
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        moved = [_to_device(v, device) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*moved)
        return type(obj)(moved)
    return obj


def _can_overlap(t: torch.Tensor, device: torch.device) -> bool:
    # A non-blocking copy *to* the CPU could be read before it lands; from pageable CPU memory
    # it is synchronous anyway. Device-to-device and pinned-host-to-device copies are ordered
    # on the streams by torch, so they may overlap with the host.
    return device.type != "cpu" and (t.device.type != "cpu" or t.is_pinned())
