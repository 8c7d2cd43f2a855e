"""``import phalanx`` imports no torch, and ``phalanx run``'s agent never does (on a machine
whose torch has no GPU build), yet everything ``import phalanx`` promised still holds whatever
the order of imports: ``torch.distributed.init_process_group("shm")`` works, the diagnostics
watch the wire, the exit guard is on, and every exported name is the object, not a module."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import phalanx
import phalanx.comm
import phalanx.recovery

SRC = Path(phalanx.__file__).resolve().parent
DEADLINE_S = 120


def _python(code: str, *args: str, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(SRC.parent)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_phalanx_and_its_launcher_import_no_torch() -> None:
    out = _python(
        """
        import sys
        import phalanx, phalanx.comm, phalanx.recovery, phalanx.cli
        import phalanx.launch.run, phalanx.launch.agent, phalanx.comm.tcpstore
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    assert out.strip() == "[]"


def test_a_launcher_runs_a_two_rank_job_without_importing_torch(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "print('SUM', int(t.item()))\n"
        "dist.destroy_process_group()\n"
    )
    out = _python(
        """
        import atexit, sys
        atexit.register(lambda: print("LAUNCHER TORCH", "torch" in sys.modules))
        from phalanx.cli import main
        sys.exit(main(["run", "--standalone", "--nproc-per-node", "2", sys.argv[1]]))
        """,
        str(script),
        cwd=tmp_path,
    )
    assert out.count("SUM 3") == 2, out  # the workers' torch clients met in our store
    assert "LAUNCHER TORCH False" in out, out


@pytest.mark.parametrize(
    "first",
    [
        "import phalanx; import torch.distributed",
        "import torch.distributed; import phalanx",
        "from phalanx.comm import all_reduce",
        "from phalanx.train import Job",
        "import phalanx.comm.shm",
    ],
)
def test_what_import_phalanx_promised_holds_in_any_order(first: str) -> None:
    out = _python(
        f"""
        {first}
        import torch.distributed as dist
        from phalanx.comm import exit_guard, watch
        from phalanx.diagnostics import tracking
        print("shm" in dist.Backend.backend_list, watch.installed() is tracking,
              exit_guard._installed)
        """
    )
    assert out.split() == ["True", "True", "True"]


@pytest.mark.parametrize("package", [phalanx, phalanx.comm, phalanx.recovery])
def test_every_exported_name_is_its_object_and_no_submodule_shadows_it(package: object) -> None:
    folder = Path(package.__file__).parent  # type: ignore[attr-defined]
    submodules = {p.stem for p in folder.glob("*.py")} | {
        p.parent.name for p in folder.glob("*/__init__.py")
    }
    names = [n for n in package.__all__ if n != "__version__"]  # type: ignore[attr-defined]
    assert not set(names) & submodules, "a name that is also a submodule resolves to the module"
    for name in names:
        value = getattr(package, name)
        assert not isinstance(value, type(sys)), f"{name} is a module"
        assert name in dir(package)


@pytest.mark.parametrize(
    ("lines", "gpu"),
    [
        (["cuda: Optional[str] = None", "hip: Optional[str] = None", "xpu = None"], False),
        (["cuda: Optional[str] = '12.8'", "hip: Optional[str] = None", "xpu = None"], True),
        (["cuda = None", "hip = '6.4.1'", "xpu = None"], True),
        (["cuda = None", "hip = None"], True),  # a build whose version.py we cannot read: ask torch
    ],
)
def test_the_launcher_knows_a_cpu_only_torch_from_its_version_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: list[str], gpu: bool
) -> None:
    from importlib.machinery import ModuleSpec

    from phalanx.launch import nproc

    (tmp_path / "version.py").write_text("\n".join(["__version__ = '2.13.0'", *lines]) + "\n")
    spec = ModuleSpec("torch", None, origin=str(tmp_path / "__init__.py"))
    monkeypatch.setattr(nproc.importlib.util, "find_spec", lambda name: spec)
    assert nproc.gpu_build() is gpu
    monkeypatch.undo()
    import torch

    built_for = [getattr(torch.version, kind, None) for kind in ("cuda", "hip", "xpu")]
    assert nproc.gpu_build() is any(built_for)  # this machine's torch, asked directly
