"""Every process's CPU while a command runs, by kind of process and by test: where ``make test``
spends the machine.

Usage::

    python tools/process_cpu.py /tmp/procs.json -- make pytest    # run it, sampling /proc
    python tools/process_cpu.py /tmp/procs.json                   # the report again

``tools/test_cpu.py`` sums what each test waited for; it misses the ranks of a
``run_distributed`` forkserver and every process reparented or killed before its parent reaped
it (about a quarter of the suite's CPU). This samples every process in ``/proc`` every 0.3 s
instead: its command line (read again for 3 s, past an ``exec``), its CPU (user + system) at
the last sample, and the ``PYTEST_CURRENT_TEST`` it inherited. A process that lives less than a
sample's interval is missed; one that existed before the command counts what it spent during it.
Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
INTERVAL_S = 0.3


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _sample(seen: dict[tuple[int, int], dict[str, object]], first: bool, me: int) -> None:
    """One pass over /proc: new processes recorded, known ones' CPU updated."""
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            stat = _read(f"/proc/{name}/stat").decode()
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu, start = (int(fields[11]) + int(fields[12])) / TICKS, int(fields[19])
            entry = seen.get((int(name), start))
            if entry is None:
                entry = seen[(int(name), start)] = {
                    "before": cpu if first else 0.0,
                    "born": time.monotonic(),
                    "test": _test_of(name),
                }
            entry["cpu"] = cpu
            if time.monotonic() - float(entry["born"]) < 3:  # its exec may come later
                command = (
                    _read(f"/proc/{name}/cmdline").replace(b"\0", b" ").decode(errors="replace")
                )
                entry["command"] = command[:300] or stat[stat.index("(") : stat.rindex(")") + 1]
        except (OSError, ValueError):
            continue  # gone between listdir and read


def _test_of(pid: str) -> str:
    try:
        environ = _read(f"/proc/{pid}/environ").split(b"\0")
    except OSError:
        return ""
    found = [v for v in environ if v.startswith(b"PYTEST_CURRENT_TEST=")]
    return found[0].split(b"=", 1)[1].decode(errors="replace") if found else ""


def run(out: Path, command: list[str]) -> int:
    """Run ``command``, sampling /proc until it ends; write the samples to ``out``."""
    seen: dict[tuple[int, int], dict[str, object]] = {}
    done = threading.Event()

    def sampler() -> None:
        first = True
        while not done.is_set():
            _sample(seen, first, os.getpid())
            first = False
            done.wait(INTERVAL_S)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        code = subprocess.call(command)
    finally:
        done.set()
        thread.join()
        rows = [{"pid": pid, **entry} for (pid, _), entry in seen.items()]
        out.write_text(json.dumps(rows))
    return code


def kind(command: str) -> str:
    """What a process was: ``phalanx run``, a script's name, a forkserver rank, a tool."""
    words = command.split()
    if not words or command.startswith("("):
        return command or "?"
    if "python" not in words[0]:
        return Path(words[0]).name
    rest = [w for w in words[1:] if w not in ("-u", "-B", "-m")]
    if not rest:
        return "python"
    if rest[0] == "-c":
        return "python -c " + " ".join(rest[1:3])[:50]
    if rest[0] in ("phalanx.launch", "torch.distributed.run") or rest[0].endswith("bin/torchrun"):
        return "launcher (phalanx.launch, torchrun)"
    if rest[0] == "phalanx" or rest[0].endswith("bin/phalanx"):
        command = rest[1] if len(rest) > 1 and not rest[1].startswith("-") else ""
        return "launcher (phalanx run)" if command == "run" else f"phalanx {command}".strip()
    return Path(rest[0]).name


def report(out: Path, top: int) -> None:
    rows = json.loads(out.read_text())
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_file: dict[str, float] = defaultdict(float)
    for row in rows:
        cpu = float(row["cpu"]) - float(row["before"])
        k = by_kind[kind(str(row.get("command", "")))]
        k[0] += 1
        k[1] += cpu
        by_file[str(row["test"]).split("::")[0] or "(no test)"] += cpu
    total = sum(cpu for _, cpu in by_kind.values())
    print(f"{total:.0f} CPU-seconds in {len(rows)} processes\n")
    print(f"{'cpu s':>8} {'procs':>6} {'each':>6}  kind")
    for name, (n, cpu) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{cpu:8.1f} {n:6.0f} {cpu / n:6.2f}  {name}")
    print(f"\n{'cpu s':>8}  test file (the test a process's environment names; a forkserver's")
    print(f"{'':>8}  ranks carry the test that started the forkserver)")
    for name, cpu in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{cpu:8.1f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], usage="%(prog)s OUT [--top N] [-- COMMAND ...]"
    )
    parser.add_argument("out", type=Path, help="the samples (JSON), written or read")
    parser.add_argument("--top", type=int, default=30)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    code = run(args.out, command) if command else 0
    report(args.out, args.top)
    sys.exit(code)


if __name__ == "__main__":
    main()
