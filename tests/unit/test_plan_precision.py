"""One precision vocabulary (``phalanx.precisions``) for ``phalanx plan`` and ``phalanx.Job``."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from torch import nn

import phalanx
from phalanx.plan.cli import main as plan_main
from phalanx.plan.memory import bytes_per_param
from phalanx.precisions import ALIASES, JOB_PRECISIONS, PRECISIONS, check_precision


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("fp32", (4, 4, 8)),
        ("bf16-mixed", (4, 4, 8)),  # autocast: fp32 parameters, gradients and Adam state
        ("fp16-mixed", (4, 4, 8)),
        ("bf16-true", (2, 2, 4)),
        ("fp16-master", (2, 2, 12)),  # the ZeRO paper's K = 12
    ],
)
def test_each_name_has_its_bytes_per_parameter(precision: str, expected: tuple) -> None:
    assert bytes_per_param("adam", precision) == expected


def test_old_spellings_mean_what_they_meant() -> None:
    assert ALIASES == {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "mixed": "fp16-master"}
    for old, new in ALIASES.items():
        assert bytes_per_param("adam", old) == bytes_per_param("adam", new)
        assert check_precision("precision", old) == new
    assert set(JOB_PRECISIONS) < set(PRECISIONS)


def _plan(*argv: str) -> list[dict[str, float]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main(["--params", "1e6", "--dp", "4", "--json", *argv]) == 0
    return json.loads(out.getvalue())


def test_plan_cli_takes_every_name_and_alias() -> None:
    assert _plan() == _plan("--precision", "mixed") == _plan("--precision", "fp16-master")
    assert _plan("--precision", "bf16") == _plan("--precision", "bf16-mixed")
    assert _plan("--precision", "bf16-mixed") == _plan("--precision", "fp32")
    true = {r["strategy"]: r for r in _plan("--precision", "bf16-true")}
    assert true["ddp"]["params"] == 2e6 and true["ddp"]["optimizer"] == 4e6


def test_plan_cli_refuses_an_unknown_name_with_the_accepted_ones() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        plan_main(["--params", "1e6", "--precision", "bf17"])
    assert "--precision" in err.getvalue() and "'bf17'" in err.getvalue()
    assert all(repr(n) in err.getvalue() for n in PRECISIONS)


@pytest.mark.parametrize("name", ["fp32", "bf16-mixed", "bf16", "bf16-true"])
def test_job_accepts_the_cpu_names(name: str) -> None:
    with phalanx.Job("single", precision=name) as job:
        assert job.precision.name == check_precision("precision", name)


def test_job_refuses_the_plan_only_precision() -> None:
    for name in ("fp16-master", "mixed"):
        with pytest.raises(ValueError, match=r"precision='(fp16-master|mixed)'.*plan"):
            phalanx.Job("single", precision=name)
    assert not phalanx.is_initialized()


def test_bf16_true_trains_a_bf16_model_on_fp32_inputs() -> None:
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    with phalanx.Job("single", precision="bf16-true") as job:
        model, _ = job.setup(net, opt)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        before = net.weight.detach().clone()
        out = model(torch.randn(3, 4))  # fp32 inputs are cast to bf16 in the forward
        assert out.dtype == torch.bfloat16
        job.backward(out.float().pow(2).mean())
        assert job.step() is True
        assert not torch.equal(before, net.weight) and net.weight.dtype == torch.bfloat16
        assert all(s.dtype == torch.bfloat16 for s in opt.state[net.weight].values() if s.dim())
