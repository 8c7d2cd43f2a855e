"""``phalanx._eager.eager``: DDP's bookkeeping runs eagerly under ``torch.compile`` without
importing dynamo in processes that never compile (it costs about 0.8 s of CPU each)."""

from __future__ import annotations

import subprocess
import sys

import torch

from phalanx._eager import eager

PROBE = """
import sys, torch
import phalanx
from phalanx.data_parallel import DistributedDataParallel
from phalanx.train.job import Job
from phalanx._eager import eager
print(eager(lambda x: x + 1)(1), "torch._dynamo" in sys.modules,
      "torch.distributed.tensor" in sys.modules)
"""


def test_importing_ddp_and_job_and_calling_an_eager_function_loads_no_dynamo() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "False", "False"]  # nor DTensor (torch's Stateful)


def test_an_eager_function_is_not_traced_under_compile() -> None:
    seen: list[bool] = []

    @eager
    def bookkeeping(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return x * 2

    compiled = torch.compile(lambda x: bookkeeping(x) + 1, backend="eager")
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert seen == [False]  # it ran, and not inside dynamo's trace
