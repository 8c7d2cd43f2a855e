"""No false hang reports (issue 15): with ``PHALANX_HANG_TIMEOUT=2`` every strategy trains for
more than 3x the threshold and no rank reports a hang, while a late peer is reported.

Two ``run_distributed`` jobs. In the first, the 2-rank families' cases (``no_hang_cases``: DDP,
ZeRO, pipeline, tensor parallel, Horovod) are built once and stepped in turn until each case has
taken at least 3 steps and its first and last step are more than 6.5 s (3x the threshold) apart.
In the second, the parameter-server modes, each a job of its own shape (1 server and 2 workers),
run back to back (in async mode one worker finishes 3 s early and waits for the final
parameters). Then every rank checks three things: it printed no hang report
(``tracking.hang_reports()``), its stderr (fd 2, Python's and native writes alike) holds no
"hang report" text, and its flight recorder holds nothing in flight (a record left open would
be reported by the next tick). The control, a pipeline stage whose neighbour sends its
activations late, is reported by the same checks.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import phalanx
from phalanx.diagnostics import tracking
from phalanx.testing import run_distributed
from tests.distributed import no_hang_cases as cases

THRESHOLD = 2.0
SECONDS = 3 * THRESHOLD + 0.5
ENV = {"PHALANX_HANG_TIMEOUT": str(THRESHOLD)}
PS_MODES = ("sync", "async", "ssp")
MIN_STEPS = 3
FAMILIES: dict[str, Callable[[], dict[str, cases.Step]]] = {
    "ddp": cases.ddp_cases,
    "zero": cases.zero_cases,
    "pipeline": cases.pipeline_cases,
    "tensor": cases.tensor_cases,
    "horovod": cases.horovod_cases,
    "local_sgd": cases.replica_cases,
}
"""The 2-rank families, stepped in turn in one job (starting ranks costs more than a case)."""


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """Send fd 2 to a file; on exit its text is appended to the list and echoed to stderr."""
    text: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield text
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text.append(tmp.read().decode(errors="replace"))
            sys.stderr.write(text[0])


def _keep_going(go: bool) -> bool:
    """True while every rank wants another round: the ranks must take the same steps."""
    flag = torch.tensor([int(go)])
    phalanx.all_reduce(flag, op=phalanx.ReduceOp.MIN)
    return bool(flag.item())


def _step_in_turn(steps: dict[str, cases.Step]) -> dict[str, Any]:
    begun: dict[str, float] = {}
    spans: dict[str, float] = {}
    rounds = 0
    while _keep_going(
        len(spans) < len(steps) or min(spans.values()) <= SECONDS or rounds < MIN_STEPS
    ):
        for name, step in steps.items():
            begun.setdefault(name, time.monotonic())
            step(rounds)
            spans[name] = time.monotonic() - begun[name]
        rounds += 1
    return {"spans": spans, "steps": dict.fromkeys(spans, rounds)}


def _parameter_server_modes() -> dict[str, Any]:
    # In async mode one worker finishes THRESHOLD + 1 s early and waits for the final parameters.
    runs = {
        mode: cases.parameter_server(mode, SECONDS, THRESHOLD + 1.0 if mode == "async" else 0.0)
        for mode in PS_MODES
    }
    return {
        "spans": {mode: span for mode, (span, _) in runs.items()},
        "steps": {mode: steps for mode, (_, steps) in runs.items()},
    }


def _verdict(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s result with this rank's hang reports, stderr reports and record in flight."""
    with _captured_stderr() as err:
        result = run()
        recorder = tracking.recorder()
        stuck = None if recorder is None else recorder.in_flight()
        result["in_flight"] = None if stuck is None else stuck.where()
        result["reports"] = tracking.hang_reports()
    result["stderr_reports"] = err[0].count("hang report")
    return result


def _two_rank_families() -> dict[str, Any]:
    steps = {
        f"{family}.{case}": step
        for family, build in FAMILIES.items()
        for case, step in build().items()
    }
    return _step_in_turn(steps)


def _check(results: list[dict[str, Any]], server: int | None) -> None:
    for rank, res in enumerate(results):
        assert res["reports"] == [] and res["stderr_reports"] == 0, (rank, res["reports"])
        assert res["in_flight"] is None, (rank, res["in_flight"])
        for case, span in res["spans"].items():
            assert span > 3 * THRESHOLD, f"rank {rank}: {case} ran {span:.1f} s"
            if rank != server:  # the server takes no steps
                assert res["steps"][case] >= MIN_STEPS, f"rank {rank}: {case}: {res['steps'][case]}"


def test_no_false_hang_report_in_any_two_rank_strategy() -> None:
    results = run_distributed(_verdict, _two_rank_families, world_size=2, env=ENV)
    for res in results:  # every family's cases ran (each has 1 to 11)
        assert {case.split(".")[0] for case in res["spans"]} == set(FAMILIES), sorted(res["spans"])
        assert len(res["spans"]) == 25, sorted(res["spans"])
    _check(results, server=None)


def test_no_false_hang_report_in_any_parameter_server_mode() -> None:
    results = run_distributed(_verdict, _parameter_server_modes, world_size=3, env=ENV)
    for res in results:
        assert set(res["spans"]) == set(PS_MODES), sorted(res["spans"])
    _check(results, server=0)


def _late_stage() -> dict[str, Any]:
    """Pipeline stage 0 sends its activations THRESHOLD + 2 s late: stage 1 waits for them."""
    step = cases.pipeline_step("1f1b")
    step(0)
    if dist.get_rank() == 0:
        time.sleep(THRESHOLD + 2.0)
    step(1)
    return {}


def test_a_late_pipeline_stage_is_reported_by_the_same_checks() -> None:
    results = run_distributed(_verdict, _late_stage, world_size=2, env=ENV)
    for res in results:
        assert len(res["reports"]) == 1 and res["stderr_reports"] == 1, res["reports"]
        text = res["reports"][0]
        assert "rank 1 has waited" in text and "from rank 0 at" in text, text
        assert "pipeline/ports.py" in text and "It waits for rank(s) [0]" in text, text
        assert "rank 0: last completed operation with rank 1: send" in text, text
        assert "time.sleep(THRESHOLD + 2.0)" in text  # rank 0's stack: where it is late
        assert res["in_flight"] is None  # the record closed once the activations came


def _streaming_long_overlap() -> dict[str, Any]:
    """Streaming DiLoCo whose averages stay in flight (launched, not yet waited for) during a
    step of THRESHOLD + 1 s of compute: the ranks wait for nothing, so nothing is reported."""
    step, sync = cases.replica_sync("streaming", compute_s=THRESHOLD + 1.0)
    for i in range(3):  # fragment 1 launches after step 1, fragment 0 after step 2, ...
        step(i)  # ... each applied after the next step
    sync.finish()  # the end of training waits for the average still in flight
    return {}


def test_a_streaming_average_in_flight_during_long_compute_is_no_hang() -> None:
    results = run_distributed(_verdict, _streaming_long_overlap, world_size=2, env=ENV)
    for rank, res in enumerate(results):
        assert res["reports"] == [] and res["stderr_reports"] == 0, (rank, res["reports"])
        assert res["in_flight"] is None, (rank, res["in_flight"])


def _late_round() -> dict[str, Any]:
    """DiLoCo's round after step 2: rank 1 reaches it THRESHOLD + 2 s late."""
    step, _ = cases.replica_sync("diloco")
    step(0)
    if dist.get_rank() == 1:
        time.sleep(THRESHOLD + 2.0)
    step(1)
    return {}


def test_a_rank_late_for_a_diloco_round_is_reported() -> None:
    results = run_distributed(_verdict, _late_round, world_size=2, env=ENV)
    for res in results:
        assert len(res["reports"]) == 1 and res["stderr_reports"] == 1, res["reports"]
        text = res["reports"][0]
        assert "rank 0 has waited" in text and "Rank(s) [1] never reached it." in text, text
        assert "local_sgd/pending_average.py" in text, text  # where rank 0 waits
        assert "time.sleep(THRESHOLD + 2.0)" in text  # rank 1's stack: where it is late
        assert res["in_flight"] is None
