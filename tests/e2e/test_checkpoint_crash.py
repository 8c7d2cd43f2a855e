"""SIGKILL inside ``checkpoint.save`` leaves the previous checkpoint loadable and unchanged.

Each fault point (``PHALANX_CHECKPOINT_FAULT``) runs in its own process, all four at once; the
fourth re-saves a step and dies between the renames of its old and new directories.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from phalanx import checkpoint
from phalanx.testing import scaled
from tests.e2e.scripts.checkpoint_crash import model_and_optimizer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "checkpoint_crash.py"
POINTS = ("mid-tensor-file", "before-manifest", "before-latest")
RESAVE = "between-renames"
Crashes = dict[str, tuple[Path, subprocess.CompletedProcess[str]]]


@pytest.fixture(scope="module")
def crashes(tmp_path_factory: pytest.TempPathFactory) -> Crashes:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    procs = {}
    for point in (*POINTS, RESAVE):
        directory = tmp_path_factory.mktemp(point)
        cmd = [sys.executable, str(SCRIPT), str(directory), point]
        procs[point] = (
            directory,
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            ),
        )
    out = {}
    for point, (directory, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=scaled(60))
        out[point] = (
            directory,
            subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
        )
    return out


@contextlib.contextmanager
def _leftover_warning(point: str) -> Iterator[None]:
    """Expect a warning naming the leftover temporary directory, except after the rename."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        yield
    messages = [str(w.message) for w in rec]
    named = any("skipping temporary checkpoint directory" in m for m in messages)
    assert named == (point != "before-latest"), messages


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_inside_save_keeps_the_previous_checkpoint(crashes: Crashes, point: str) -> None:
    directory, run = crashes[point]
    assert run.returncode == -signal.SIGKILL, run.stderr
    committed = json.loads(run.stdout.splitlines()[0])
    previous = directory / "step-000001"
    assert (directory / "latest").read_text() == "step-000001\n"
    assert _digests(previous) == committed  # byte-for-byte what was committed

    model, opt = model_and_optimizer()
    with _leftover_warning(point):
        info = checkpoint.load(directory, model=model, optimizer=opt)
    assert info is not None and info.step == 1 and info.extra == {"tag": "one"}
    assert _digests(previous) == committed


def test_the_kill_happened_where_intended(crashes: Crashes) -> None:
    directory, _ = crashes["mid-tensor-file"]
    (tmp,) = directory.glob(".tmp-step-000002-*")
    full = (directory / "step-000001" / "model.safetensors").stat().st_size
    assert (tmp / "model.safetensors").stat().st_size == full // 2
    directory, _ = crashes["before-manifest"]
    (tmp,) = directory.glob(".tmp-step-000002-*")
    assert (tmp / "optimizer.safetensors").exists() and not (tmp / "manifest.json").exists()
    directory, _ = crashes["before-latest"]
    assert (directory / "step-000002" / "manifest.json").exists()  # renamed, not yet "latest"


def test_leftovers_are_named_then_cleaned_by_the_next_save(crashes: Crashes) -> None:
    directory, _ = crashes["mid-tensor-file"]
    (tmp,) = directory.glob(".tmp-step-000002-*")
    with pytest.warns(UserWarning, match=f"skipping temporary checkpoint directory {tmp}"):
        assert checkpoint.latest(directory) == directory / "step-000001"
    for point in POINTS:
        directory, _ = crashes[point]
        model, opt = model_and_optimizer()
        with _leftover_warning(point):
            checkpoint.load(directory, model=model, optimizer=opt)
        with torch.no_grad():
            model.state_dict()["0.weight"].add_(1.0)
        for step in (2, 3):
            checkpoint.save(directory, step, model=model, optimizer=opt, keep_last=2)
        assert sorted(os.listdir(directory)) == ["latest", "step-000002", "step-000003"]
        fresh, _ = model_and_optimizer()
        info = checkpoint.load(directory, model=fresh)
        assert (
            info is not None
            and info.step == 3
            and torch.equal(fresh.state_dict()["0.weight"], model.state_dict()["0.weight"])
        )


def test_sigkill_between_the_renames_of_a_resaved_step_loses_nothing(crashes: Crashes) -> None:
    directory, run = crashes[RESAVE]
    assert run.returncode == -signal.SIGKILL, run.stderr
    committed = json.loads(run.stdout.splitlines()[0])
    (aside,) = directory.glob(".replaced-step-000001-*")
    (new,) = directory.glob(".tmp-step-000001-*")
    # the kill landed between the renames: the old copy is aside, the new one complete but
    # not in its place, and keep_last=1 left no other checkpoint
    assert not (directory / "step-000001").exists() and (new / "manifest.json").exists()
    assert (directory / "latest").read_text() == "step-000001\n"
    assert _digests(aside) == committed

    model, opt = model_and_optimizer()
    with pytest.warns(UserWarning, match="names step-000001, which is missing"):
        info = checkpoint.load(directory, model=model, optimizer=opt)
    assert info is not None and info.step == 1 and info.extra == {"tag": "one"}  # the old state
    info = checkpoint.load(directory, model=model, path="step-000001")  # by name, too
    assert info is not None and info.extra == {"tag": "one"} and info.path == aside.absolute()

    # the next save gives the old copy its name back and its prune deletes only the
    # interrupted save's leftovers
    checkpoint.save(directory, 2, model=model, optimizer=opt, keep_last=2)
    assert sorted(os.listdir(directory)) == ["latest", "step-000001", "step-000002"]
    assert _digests(directory / "step-000001") == committed
    fresh, _ = model_and_optimizer()
    info = checkpoint.load(directory, model=fresh, path="step-000001")
    assert info is not None and info.extra == {"tag": "one"}
    assert torch.equal(fresh.state_dict()["0.weight"], model.state_dict()["0.weight"])

    # re-saving the step now completes: the new state replaces the old, nothing else is left
    with torch.no_grad():
        model.state_dict()["0.weight"].add_(1.0)
    checkpoint.save(directory, 1, model=model, optimizer=opt, extra={"tag": "new"}, keep_last=1)
    assert sorted(os.listdir(directory)) == ["latest", "step-000001"]
    info = checkpoint.load(directory, model=fresh)
    assert info is not None and info.step == 1 and info.extra == {"tag": "new"}
    assert torch.equal(fresh.state_dict()["0.weight"], model.state_dict()["0.weight"])


ASYNC_SAVER = Path(__file__).resolve().parent / "scripts" / "async_saver.py"


def test_sigkill_inside_an_asynchronous_write_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    from tests.e2e.scripts.async_saver import verify

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    procs = {}
    for point in ("mid-tensor-file", "before-latest"):  # inside the write; after the rename
        directory = tmp_path / point
        cmd = [sys.executable, str(ASYNC_SAVER), str(directory), str(tmp_path / f"{point}.log")]
        cmd += ["--mb", "2", "--saves", "3", "--fault", point]
        procs[point] = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    for point, proc in procs.items():
        _, stderr = proc.communicate(timeout=scaled(60))
        assert proc.returncode == -signal.SIGKILL, stderr  # killed by its background write
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the leftover temporary directory is named
            found = verify(tmp_path / point, tmp_path / f"{point}.log", 2)
        assert found == {
            "loaded": 1,  # step 2's write was killed: step 1 is in force, as it was saved
            "committed": 1,
            "equal": True,
            "in_write": point == "mid-tensor-file",
        }, point
