"""Start-up hook of ``phalanx run``'s workers: install phalanx's exit guard, then step aside.

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
    _chain()


if __name__ == "sitecustomize":
    _main()
