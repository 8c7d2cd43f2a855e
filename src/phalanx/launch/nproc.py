"""How many workers this node starts: ``--nproc-per-node auto|cpu|gpu|xpu|N``, and a sane cap.

The device names resolve exactly as torchrun's ``determine_local_world_size`` does: ``cpu`` is
the CPUs this process may run on, ``gpu`` / ``xpu`` the devices of that kind (an error when there
are none), ``auto`` the accelerator's devices if there is one, else the CPUs. The device counts
come from a *probe*, so the decision is a pure function; the default probe asks torch, unless
torch's build has no GPU support at all (:func:`gpu_build`): then the launcher never imports it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import resource
from collections.abc import Callable, Mapping
from pathlib import Path

from phalanx.launch.config import ArgsError

__all__ = [
    "MAX_ENV",
    "DeviceProbe",
    "cuda_available",
    "gpu_build",
    "local_world_size",
    "nproc_limit",
    "probe_devices",
]

DeviceProbe = Callable[[str], "int | None"]
"""``probe(kind)``: device count of ``kind`` (cpu, gpu, xpu, accelerator, or torch's custom
backend name), or None when that kind is not available here."""

MAX_ENV = "PHALANX_MAX_NPROC_PER_NODE"
PER_CPU = 8
"""Workers per usable CPU before ``phalanx run`` refuses (each is a process, usually a Python
interpreter that imports torch: ~0.3 GB and a second or two of CPU to start)."""
FLOOR = 32
"""The limit is never below this, so small machines can still test many-rank logic."""


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def gpu_build() -> bool:
    """Whether the installed torch was built for a GPU (CUDA, ROCm or XPU), read from its
    ``torch/version.py`` without importing torch (1.5 CPU-seconds); True when that cannot be
    read, so the callers ask torch itself."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return True
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return True
    found = dict(re.findall(r"^(cuda|hip|xpu)\b[^=]*=\s*(.+?)\s*$", text, re.MULTILINE))
    return set(found) != {"cuda", "hip", "xpu"} or any(v != "None" for v in found.values())


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing a torch built for the CPU only."""
    if not gpu_build():
        return False
    import torch

    return bool(torch.cuda.is_available())


def probe_devices(kind: str) -> int | None:
    """Device count of ``kind`` as torchrun finds it (imports torch unless ``kind`` is cpu, or
    ``auto`` / ``gpu`` with a torch built for the CPU only)."""
    if kind == "cpu":
        return _cpu_count()
    if kind in ("gpu", "accelerator") and not gpu_build():
        return None
    import torch

    if kind == "gpu":
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else None
    if kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        return int(xpu.device_count()) if xpu is not None and xpu.is_available() else None
    if kind == "accelerator":  # torch.accelerator appeared in torch 2.6
        accel = getattr(torch, "accelerator", None)
        if accel is None:
            return int(torch.cuda.device_count()) if torch.cuda.is_available() else None
        return int(accel.device_count()) if accel.is_available() else None
    if kind == torch._C._get_privateuse1_backend_name():
        module = getattr(torch, kind, None)
        return int(module.device_count()) if module is not None else None
    return None


def local_world_size(raw: str, probe: DeviceProbe) -> int:
    """Resolve ``--nproc-per-node``; raises ArgsError naming the value and what is available."""
    try:
        return int(raw)
    except ValueError:
        pass
    if raw == "auto":
        count = probe("accelerator")
        return count if count is not None else _need(raw, probe("cpu"))
    if raw in ("cpu", "gpu", "xpu"):
        return _need(raw, probe(raw))
    count = probe(raw) if raw.isidentifier() else None  # torch's custom (privateuse1) backend
    if count is None:
        raise ArgsError(
            f"--nproc-per-node {raw!r} is not one of auto, cpu, gpu, xpu or a number (nor an "
            f"available custom device type)"
        )
    return count


def _need(raw: str, count: int | None) -> int:
    if count is None:
        what = {"gpu": "CUDA", "xpu": "XPU"}.get(raw, raw)
        raise ArgsError(
            f"--nproc-per-node {raw}: {what} is not available on this machine; pass a number, "
            f"'cpu' or 'auto'"
        )
    return count


def nproc_limit(environ: Mapping[str, str], cpus: int | None = None) -> tuple[int, str]:
    """The most workers one node may start, and why (for the error message)."""
    override = environ.get(MAX_ENV)
    if override:
        try:
            return int(override), f"{MAX_ENV}={override}"
        except ValueError:
            raise ArgsError(f"{MAX_ENV}={override!r} is not an integer") from None
    cpus = _cpu_count() if cpus is None else cpus
    limit = max(FLOOR, PER_CPU * cpus)
    why = (
        f"{PER_CPU} workers per usable CPU ({PER_CPU} x {cpus}), at least {FLOOR}: each worker "
        f"is a separate process, usually a Python interpreter that imports torch (~0.3 GB), so "
        f"more only time-slices the cores and exhausts memory"
    )
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and soft < limit:
        return int(soft), f"the process limit of this user (ulimit -u {soft})"
    return limit, why


def check_nproc(n: int, raw: str, environ: Mapping[str, str], cpus: int | None = None) -> int:
    """``n`` if it is a sane number of workers for this node, else ArgsError (before any start)."""
    shown = raw if raw == str(n) else f"{raw} (= {n})"
    if n < 1:
        raise ArgsError(f"--nproc-per-node {shown} is invalid: it must be at least 1")
    limit, why = nproc_limit(environ, cpus)
    if n > limit:
        raise ArgsError(
            f"--nproc-per-node {shown} is more workers than this machine can run: the limit "
            f"here is {limit} ({why}). Pass at most {limit}, or set {MAX_ENV} to raise the limit"
        )
    return n
