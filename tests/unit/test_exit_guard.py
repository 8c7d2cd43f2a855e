"""The exit guard sees gloo's threads (also after destroy_process_group, while DDP holds the
group), and holds back finalization only then. The race it closes: tools/exit_race.sh."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os, tempfile, time
import torch, torch.distributed as dist
import phalanx
from phalanx.comm import exit_guard
print("before", exit_guard._gloo_threads_alive())
path = os.path.join(tempfile.mkdtemp(), "rdzv")
dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
model = phalanx.DistributedDataParallel(torch.nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
dist.destroy_process_group()
print("after", exit_guard._gloo_threads_alive())
start = time.monotonic()
exit_guard._let_gloo_threads_finish()
print("held", round(time.monotonic() - start, 3))
"""


def test_the_guard_sees_gloo_threads_only_when_there_are_some() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out[:4] == ["before", "False", "after", "True"], out
    assert out[4] == "held" and float(out[5]) >= 0.05, out
