"""Start-up hook of ``phalanx run``'s workers: install phalanx's exit guard, watch for
Accelerate on CPU, then step aside.

``site`` imports this file as ``sitecustomize`` at interpreter start because ``phalanx run`` put
its folder first on the worker's PYTHONPATH (:mod:`phalanx.launch.worker_site` says why). It
imports the standard library only: it runs before the user's script, which must find torch (and
phalanx) not yet imported. Imported under any other name, it does nothing.
"""

import os
import sys

USER_PYTHONPATH_ENV = "PHALANX_USER_PYTHONPATH"
"""The user's own PYTHONPATH, set by the launcher when there was one (unset: there was none)."""
GUARD_NAME = "_phalanx_exit_guard"
"""``sys.modules`` name of the guard loaded here (``phalanx.comm.exit_guard.HOOKED_NAME``)."""
ACCELERATE_ENV = "PHALANX_ACCELERATE_USE_CPU"
"""Set by the launcher (to 1) for CPU workers of a job of 2 or more ranks when the user did not
set ACCELERATE_USE_CPU: the hook then sets it when the script looks for ``accelerate``."""
ACCELERATE_NOTE = (
    "phalanx run: ACCELERATE_USE_CPU=1 for the workers, which run on the CPU: without it "
    "Accelerate ignores WORLD_SIZE there and each rank trains alone; set ACCELERATE_USE_CPU "
    "yourself to decide\n"
)
"""What rank 0 says, once, when it sets ACCELERATE_USE_CPU."""
BIND_ENV = "PHALANX_BIND_CORES"
"""Set by ``phalanx run --bind-cores`` to this worker's cores (``0,1``): it pins itself to them
(:mod:`phalanx.launch.cores` plans them)."""


class AccelerateOnCpu:
    """A ``sys.meta_path`` entry that finds nothing: the first time the script imports or looks
    for ``accelerate`` (directly, or through ``transformers``' Trainer), it sets
    ACCELERATE_USE_CPU=1, which Accelerate reads when its state is made, after the import."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        # It stays on sys.meta_path, done: importlib iterates over that list while it asks.
        if name != "accelerate" or self.done:
            return None
        self.done = True
        if "ACCELERATE_USE_CPU" not in os.environ:
            os.environ["ACCELERATE_USE_CPU"] = "1"
            if os.environ.get("RANK") == "0":
                sys.stderr.write(ACCELERATE_NOTE)
        return None


def _watch_accelerate() -> None:
    if os.environ.pop(ACCELERATE_ENV, None) == "1":
        sys.meta_path.insert(0, AccelerateOnCpu())


def _bind_cores() -> None:
    """Pin this process (and the threads it will start) to the cores in :data:`BIND_ENV`."""
    text = os.environ.pop(BIND_ENV, None)
    if text is None:
        return
    try:
        os.sched_setaffinity(0, {int(c) for c in text.split(",")})
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"phalanx run: --bind-cores: could not pin to cores {text}: {exc}\n")


def _step_aside(here: str) -> None:
    """Take this folder off ``sys.path`` and put the user's PYTHONPATH back in ``os.environ``,
    so the script, its subprocesses and any other ``sitecustomize`` see what torchrun gives."""
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry) != here]
    sys.path_importer_cache.pop(here, None)
    user = os.environ.pop(USER_PYTHONPATH_ENV, None)
    if user is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = user


def _install_guard(here: str) -> None:
    """Load ``phalanx/comm/exit_guard.py`` alone (the package would import torch) and install it."""
    from importlib.util import module_from_spec, spec_from_file_location

    path = os.path.join(os.path.dirname(os.path.dirname(here)), "comm", "exit_guard.py")
    spec = spec_from_file_location(GUARD_NAME, path)
    assert spec is not None and spec.loader is not None, path
    guard = module_from_spec(spec)
    sys.modules[GUARD_NAME] = guard
    spec.loader.exec_module(guard)
    guard.install()


def _chain() -> None:
    """Run the ``sitecustomize`` this file shadows (the user's, site-packages' or the system's)
    as ``site`` would have: it becomes ``sys.modules["sitecustomize"]``; its errors are
    reported by ``site`` as they would be without phalanx."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    spec = PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    _step_aside(here)
    try:
        _install_guard(here)
    except Exception as exc:  # the script must run all the same; say once what is missing
        sys.stderr.write(f"phalanx run: the exit guard is not installed in this worker: {exc!r}\n")
    _watch_accelerate()
    _bind_cores()
    _chain()


if __name__ == "sitecustomize":
    _main()
