"""phalanx as ``pip install phalanx`` leaves it: no extras, no test tools (``make smoke-noextras``).

Run by the interpreter of a fresh venv holding torch and ``pip install .`` only. Checks, each
timed: the optional packages are really absent; every module of the installed package imports;
``phalanx.checkpoint`` round-trips a model and optimizer after a bare ``import phalanx``; each
missing extra is named with its pip line before any work starts (``Job(tensorboard_dir=...)``,
``examples/digits.py``, ``phalanx bench param_server``); a 2-rank ZeRO-1 ``Job`` with
``checkpoint_dir`` under ``phalanx run`` saves and then resumes from per-rank pieces; ``phalanx
bench comm --quick`` writes its results where ``--out`` says. Exits 1 naming the first failure.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABSENT = ("sklearn", "matplotlib", "tensorboard", "pytest")
CORE = ("torch", "numpy", "tqdm", "safetensors", "crc32c")  # checkpoints need the last two


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SystemExit(f"no-extras smoke: FAILED: {message}")


def run(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def absent_extras() -> None:
    here = [m for m in ABSENT if importlib.util.find_spec(m) is not None]
    check(not here, f"{here} importable: this venv must hold `pip install .` without extras")
    gone = [m for m in CORE if importlib.util.find_spec(m) is None]
    check(not gone, f"{gone} not installed by `pip install .`: pyproject's dependencies lack them")
    import phalanx

    installed = Path(phalanx.__file__).resolve()
    check(ROOT / "src" not in installed.parents, f"phalanx comes from the source tree: {installed}")


def checkpoint_round_trip(tmp: Path) -> None:
    import torch

    import phalanx  # the subpackage must be an attribute after this import alone

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.randn(2, 4)).sum().backward()
    opt.step()
    phalanx.checkpoint.save(tmp / "ckpt", 7, model=net, optimizer=opt)
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    info = phalanx.checkpoint.load(tmp / "ckpt", model=fresh, optimizer=fresh_opt)
    check(info is not None and info.step == 7, f"load returned {info}")
    for a, b in zip(net.state_dict().values(), fresh.state_dict().values(), strict=True):
        check(torch.equal(a, b), "the loaded model differs from the saved one")
    saved, loaded = opt.state_dict()["state"][0], fresh_opt.state_dict()["state"][0]
    check(torch.equal(saved["exp_avg"], loaded["exp_avg"]), "the optimizer state differs")


def every_module_imports() -> None:
    import phalanx

    names = [m.name for m in pkgutil.walk_packages(phalanx.__path__, "phalanx.")]
    for name in names:
        if not name.endswith("__main__"):  # those run a command
            importlib.import_module(name)
    check(len(names) > 100, f"only {len(names)} modules found")


def missing_extras_are_named(tmp: Path) -> None:
    from phalanx.train.metrics import MetricsLogger

    try:
        MetricsLogger(tensorboard_dir=str(tmp / "tb"))
    except ImportError as exc:
        check("pip install 'phalanx[tensorboard]'" in str(exc), f"tensorboard: {exc}")
    else:
        check(False, "MetricsLogger(tensorboard_dir=...) did not raise without tensorboard")
    demo = run(str(ROOT / "examples" / "digits.py"), cwd=tmp)
    check(demo.returncode != 0, "examples/digits.py ran without scikit-learn")
    check("pip install 'phalanx[examples]'" in demo.stderr, f"digits.py said: {demo.stderr}")
    bench = run("-m", "phalanx", "bench", "param_server", "--quick", cwd=tmp)
    check(bench.returncode == 2, f"bench param_server exited {bench.returncode}: {bench.stderr}")
    check("pip install 'phalanx[bench]'" in bench.stderr, f"bench said: {bench.stderr}")
    check(not (tmp / "runs").exists(), "bench param_server started work before the check")


def two_rank_job(tmp: Path) -> None:
    script, ckpt = str(ROOT / "tests" / "noextras" / "job.py"), str(tmp / "job")
    launch = ("-m", "phalanx", "run", "--standalone", "--nproc-per-node", "2", script, ckpt)
    first = run(*launch, "2", cwd=tmp)
    check(first.returncode == 0, f"the 2-rank Job failed:\n{first.stdout}\n{first.stderr}")
    check(any((tmp / "job").glob("step-*/optimizer-shard-00001.json")), "no sharded checkpoint")
    again = run(*launch, "3", cwd=tmp)
    out = again.stdout + again.stderr
    check(again.returncode == 0, f"the resumed Job failed:\n{out}")
    check("resumed from" in out and "step 12" in out, f"the Job did not resume:\n{out}")


def bench_comm(tmp: Path) -> None:
    out = tmp / "comm"
    bench = run("-m", "phalanx", "bench", "comm", "--quick", "--out", str(out), cwd=tmp)
    check(bench.returncode == 0, f"bench comm failed:\n{bench.stdout}\n{bench.stderr}")
    check(bench.stdout.splitlines()[-1].startswith("RESULT "), "bench comm: no RESULT line")
    check((out / "comm.json").is_file() and (out / "rows.jsonl").is_file(), "no results in --out")


def main() -> int:
    steps: list[tuple[str, Callable[[Path], None]]] = [
        ("optional packages absent", lambda _: absent_extras()),
        ("checkpoint round trip after `import phalanx`", checkpoint_round_trip),
        ("every module imports", lambda _: every_module_imports()),
        ("missing extras named with their pip line", missing_extras_are_named),
        ("2-rank Job with checkpoint_dir, then resumed", two_rank_job),
        ("phalanx bench comm --quick --out DIR", bench_comm),
    ]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="phalanx-noextras-") as tmp:
        for name, step in steps:
            t = time.perf_counter()
            step(Path(tmp))
            print(f"no-extras smoke: ok   {name} ({time.perf_counter() - t:.1f} s)", flush=True)
    print(f"no-extras smoke: passed in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
