"""The package as users meet it: subpackages as attributes, extras named with their pip line."""

from __future__ import annotations

import importlib.util
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx
from phalanx import _optional, cli
from phalanx._optional import EXTRAS, MissingExtraError, require

ROOT = Path(__file__).resolve().parents[2]


def _public_modules() -> list[str]:
    return [m.name for m in pkgutil.iter_modules(phalanx.__path__) if not m.name.startswith("_")]


def test_every_public_module_is_listed_for_lazy_loading() -> None:
    assert set(_public_modules()) <= set(phalanx._SUBMODULES), "add it to phalanx._SUBMODULES"


def test_every_subpackage_is_an_attribute_after_import_phalanx() -> None:
    # A fresh interpreter: here the test process has imported most subpackages already.
    code = (
        "import phalanx, sys\n"
        "assert 'phalanx.checkpoint' not in sys.modules  # loaded on first use, not by import\n"
        "phalanx.checkpoint.save, phalanx.testing.run_distributed, phalanx.horovod.init\n"
        f"for name in {_public_modules()!r}:\n"
        "    assert getattr(phalanx, name).__name__ == 'phalanx.' + name, name\n"
        "assert 'checkpoint' in dir(phalanx)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_checkpoint_save_and_load_through_the_package_attribute(tmp_path: Path) -> None:
    # issue 17: ``phalanx.checkpoint.save(...)`` after ``import phalanx`` raised AttributeError
    code = (
        "import sys, torch, phalanx\n"
        "model = torch.nn.Linear(2, 2)\n"
        "path = phalanx.checkpoint.save(sys.argv[1], 5, model=model)\n"
        "info = phalanx.checkpoint.load(sys.argv[1], model=torch.nn.Linear(2, 2))\n"
        "assert info.step == 5 and info.path == path, info\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_an_unknown_attribute_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'chekpoint'"):
        _ = phalanx.chekpoint  # type: ignore[attr-defined]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0] for r in requirements}


def test_extras_table_matches_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for extra, provides in EXTRAS.items():
        assert _names(extras[extra]) == set(provides.values()), extra
    assert "phalanx[examples,bench,tensorboard]" in extras["dev"]  # dev has every feature
    core = {"torch", "numpy", "tqdm", "safetensors", "crc32c"}  # the last two: checkpoints
    assert _names(project["dependencies"]) == core
    assert all(re.search(r">=\d", r) for r in project["dependencies"]), "lower bounds"


def _without(monkeypatch: pytest.MonkeyPatch, *missing: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )


def test_require_names_the_feature_the_packages_and_the_pip_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require("bench", "anything")  # installed here (the dev extra)
    _without(monkeypatch, "sklearn", "matplotlib")
    with pytest.raises(MissingExtraError) as info:
        require("bench", "phalanx bench param_server")
    assert str(info.value) == (
        "phalanx bench param_server needs scikit-learn and matplotlib, which are not installed: "
        "pip install 'phalanx[bench]'"
    )
    assert isinstance(info.value, ImportError)
    with pytest.raises(MissingExtraError, match=r"^x needs scikit-learn, which is not"):
        require("examples", "x")
    assert _optional.install_line("tensorboard") == "pip install 'phalanx[tensorboard]'"


@pytest.mark.parametrize(
    ("missing", "named"),
    [("sklearn", "param_server needs scikit-learn"), ("matplotlib", "skips it) needs matplotlib")],
)
def test_bench_param_server_names_a_missing_extra_before_any_work(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    missing: str,
    named: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    _without(monkeypatch, missing)
    assert cli.main(["bench", "param_server", "--quick"]) == 2
    err = capsys.readouterr().err
    assert named in err and "pip install 'phalanx[bench]'" in err, err
    assert not (tmp_path / "runs").exists(), "it started before checking"


def test_an_example_names_its_extra_before_it_starts(tmp_path: Path) -> None:
    # sklearn hidden from the script: importlib.util.find_spec("sklearn") is then None
    hide = (
        "import sys, runpy\n"
        "sys.modules['sklearn'] = None\n"
        f"sys.argv = [{str(ROOT / 'examples' / 'digits.py')!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    cmd = [sys.executable, "-c", hide]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "phalanx._optional.MissingExtraError: examples/digits.py needs scikit-learn, which is "
        "not installed: pip install 'phalanx[examples]'"
    ), proc.stderr
    assert not (tmp_path / "runs").exists()


def test_every_export_is_explained_in_the_package_docstring() -> None:
    doc = phalanx.__doc__ or ""
    section = doc[doc.index("What ``__all__`` exports") : doc.index("Logging:")]
    missing = [n for n in phalanx.__all__ if f"``{n}``" not in section]
    assert not missing, f"say why phalanx exports {missing} (phalanx/__init__.py's docstring)"
    for name in phalanx.__all__:  # and each one resolves
        assert getattr(phalanx, name) is not None, name


def test_internal_names_are_not_exported_but_stay_importable() -> None:
    from phalanx.comm import CollectiveMismatchError, CollectiveTimeoutError
    from phalanx.plan import MemoryReport
    from phalanx.train import Single, Strategy, register_strategy

    for obj in (CollectiveMismatchError, CollectiveTimeoutError, MemoryReport, Single, Strategy):
        assert obj.__name__ not in phalanx.__all__
    assert "register_strategy" not in phalanx.__all__ and callable(register_strategy)
