"""Which backend the workers get (issue 35, points 5 and 7): ``phalanx run --backend shm``, the
start-up line of each generation (and the change when an elastic job lands on one machine),
and the one "auto" rule the workers, the launcher and ``phalanx doctor`` share."""

from __future__ import annotations

import pytest
import torch

from phalanx.comm import backends, group
from phalanx.launch import args
from phalanx.launch.args import ArgsError, parse_args
from phalanx.launch.backend_note import BackendNotes, backend_note
from phalanx.launch.options import build_parser


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU machine that can run shm, whatever this one is; no PHALANX_BACKEND inherited."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(backends, "shm_unusable", lambda: None)
    monkeypatch.delenv("PHALANX_BACKEND", raising=False)


def test_backend_shm_is_accepted_and_passed_to_the_workers() -> None:
    assert parse_args(["--backend", "shm", "x.py"]).backend == "shm"
    with pytest.raises(ArgsError, match="--backend 'tcp' is not one of auto, gloo, nccl, mpi, shm"):
        parse_args(["--backend", "tcp", "x.py"])


def test_backend_shm_where_it_cannot_run_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(args, "shm_unusable", lambda: "Linux on aarch64 (it needs x86-64)")
    with pytest.raises(ArgsError) as info:
        parse_args(["--backend", "shm", "x.py"])
    assert str(info.value) == (
        "--backend shm: the shared-memory backend cannot run on Linux on aarch64 (it needs "
        "x86-64); pass --backend gloo"
    )


def test_help_lists_shm_and_the_default_rule() -> None:
    text = " ".join(build_parser({}).format_help().split())
    assert "--backend auto|gloo|nccl|mpi|shm" in text
    assert (
        "shm (shared memory) for CPU ranks all on one machine, or on several machines that "
        "each run 2 or more (shared memory inside each, gloo between them), else gloo" in text
    )


def test_the_start_up_line_says_what_was_chosen() -> None:
    assert backend_note("shm", 2, 2) == ", backend shm (shared memory: every rank on this machine)"
    assert backend_note("shm", 4, 2) == (
        ", backend shm (shared memory inside each machine, gloo between the machines)"
    )
    assert backend_note("gloo", 2, 2) == ", backend gloo"
    one_machine = ", default backend shm (CPU ranks on one machine; --backend gloo opts out)"
    assert backend_note(None, 2, 2) == one_machine
    assert backend_note("auto", 2, 2) == one_machine  # not ", backend auto"
    assert backend_note(None, 4, 2) == ", default backend gloo (CPU ranks on several machines)"
    single = ", default backend gloo (a single rank: nothing to share)"
    assert backend_note(None, 1, 1) == backend_note(None, 1, 1, fewest_local=1) == single


def test_the_launchers_own_phalanx_backend_counts_as_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PHALANX_BACKEND", "SHM")
    assert backend_note(None, 2, 2) == ", backend shm (shared memory: every rank on this machine)"


def test_an_elastic_job_that_lands_on_one_machine_is_told_the_backend_changed() -> None:
    notes = BackendNotes(None, environ={})
    assert notes.note(4, 2) == ", default backend gloo (CPU ranks on several machines)"
    assert notes.note(4, 2) == ", default backend gloo (CPU ranks on several machines)"
    assert notes.note(2, 2) == (
        ", default backend shm (changed from gloo: CPU ranks on one machine; --backend gloo "
        "keeps gloo)"
    )
    assert notes.note(2, 2) == (
        ", default backend shm (CPU ranks on one machine; --backend gloo opts out)"
    )
    assert notes.note(4, 2) == (
        ", default backend gloo (changed from shm: CPU ranks on several machines; --backend shm "
        "keeps shm)"
    )


def test_a_chosen_backend_never_changes_between_generations() -> None:
    notes = BackendNotes("gloo", environ={})
    assert [notes.note(n, 2) for n in (4, 2, 4)] == [", backend gloo"] * 3


def test_auto_falls_back_to_gloo_where_shm_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backends.auto_backend(gpu=False, one_machine=True) == ("shm", "CPU ranks on one machine")
    assert backends.auto_backend(gpu=True, one_machine=True) == ("nccl", "GPU ranks")
    assert backends.auto_backend(gpu=False, one_machine=False)[0] == "gloo"
    monkeypatch.setattr(backends, "shm_unusable", lambda: "Darwin on arm64")
    assert backends.auto_backend(gpu=False, one_machine=True) == (
        "gloo",
        "CPU ranks on one machine, but shm cannot run on Darwin on arm64",
    )
    assert group.resolve_backend(None, 0, one_machine=True) == "gloo"
    assert backend_note(None, 2, 2) == (
        ", default backend gloo (CPU ranks on one machine, but shm cannot run on Darwin on arm64)"
    )
