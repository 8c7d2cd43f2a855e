"""Write docs/benchmarks.md from benchmarks/results/: ``python tools/bench_page.py``.

Every result file is read: a ``.txt`` (a benchmark's printed output) is shown without its
progress lines (``measured: ...``) and its machine-readable ``RESULT {...}`` line; a ``.png`` is
copied to ``docs/assets/benchmarks/`` and shown; a ``.json`` whose suite is known here becomes a
table. Each result names the command that produced it, the machine and the date as the file
records them (a ``$ command`` or ``# phalanx ...`` header line, a ``2-core ...`` machine line, a
date, the ``date`` command's output, or the timestamp of the run directory it printed) and says
"not recorded" where the file does not: nothing is filled in from elsewhere.

``--check`` writes nothing and exits 1 if the page or its figures differ from what the results
give (tests/docs/test_site.py runs it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
PAGE = "benchmarks.md"
FIGURES = "assets/benchmarks"  # under docs/, so that MkDocs copies them into the site
NOT_RECORDED = "not recorded"


@dataclass(frozen=True)
class Topic:
    title: str
    guide: str  # the feature page that explains these results, and its title
    guide_title: str
    stems: dict[str, str]  # result name -> what it measures


TOPICS = (
    Topic(
        "Shared-memory backend on one machine",
        "shm.md",
        "Shared-memory backend",
        {
            "shm_comm": "all_reduce, reduce_scatter and all_gather from 1 MiB: gloo against "
            "the shm backend and a plain memcpy, 2 ranks",
            "shm_ddp": "a DDP step of an MLP: torch DDP against phalanx DDP on gloo and on shm, "
            "2 ranks, three runs",
            "shm_zero_and_small": "ZeRO-1/2/3 on gloo and on shm against torch's "
            "ZeroRedundancyOptimizer and FSDP (char GPT, 2 ranks); small-message latency",
        },
    ),
    Topic(
        "DDP on gloo",
        "data-parallel.md",
        "Data parallel",
        {
            "ddp_gloo": "phalanx DDP against torch DDP on gloo, MLP and CNN at 1, 4 and 25 MB "
            "buckets, 2 ranks, two runs (after the bucket layout became torch's)",
        },
    ),
    Topic(
        "Across machines: the hierarchical shm group against gloo",
        "shm.md",
        "Shared-memory backend",
        {
            "hosts_backend": "a DDP step on 2 namespace hosts x 2 ranks at 100 Mbit/s and "
            "1 Gbit/s: the hierarchical group (shm inside, gloo between) against gloo",
            "hosts_backend_2x4": "the same at 2 hosts x 4 ranks",
        },
    ),
    Topic(
        "Hybrid ZeRO over a slow link",
        "zero.md",
        "ZeRO sharding",
        {
            "zero_hybrid": "ZeRO sharded inside each host and replicated across hosts, against "
            "ZeRO-3, DDP, torch HSDP and FSDP; 2 hosts x 2 ranks, 100 Mbit/s",
        },
    ),
    Topic(
        "Activation checkpointing",
        "activation-checkpointing.md",
        "Activation checkpointing",
        {
            "activations": "char GPT on 2 ranks under ZeRO-3 and Mesh(pp=2): the peak memory "
            "and time of a training step without checkpointing, with full and selective "
            "checkpointing, and with torch's checkpoint_wrapper, interleaved",
        },
    ),
    Topic(
        "Checkpoints",
        "checkpoints.md",
        "Checkpoints",
        {
            "checkpoint_bench": "save, warm and cold load, asynchronous save: phalanx against "
            "torch DCP and a raw write, 100 MB and 1 GB, 1 and 2 ranks",
            "checkpoint_slowdown": "training steps beside an asynchronous save: phalanx "
            "against torch DCP's writer thread and writer process, 100 MB and 1 GB, 1 and 2 "
            "ranks, 5 rounds (with the saves and loads of checkpoint_bench again)",
        },
    ),
    Topic(
        "Pipeline schedules",
        "model-parallel.md",
        "Model parallel",
        {
            "pipeline_zbh1": "ZB-H1 against 1F1B, phalanx's and torch's, 4 stages, 8 "
            "micro-batches, sleep-calibrated stages whose backward is half the weights'",
        },
    ),
    Topic(
        "Parameter servers and stragglers",
        "async.md",
        "Asynchronous training",
        {
            "param_server": "DDP, parameter server sync and async, SSP s=2 and s=4 on digits "
            "(1 server + 2 workers) with no, a 2x, a 4x and a random 4x straggler",
        },
    ),
    Topic(
        "Training over a slow link",
        "async.md",
        "Asynchronous training",
        {
            "low_bandwidth": "a char GPT on two namespace hosts over 100 Mbit/s: DDP, PowerSGD, "
            "async PS, LocalSGD, DiLoCo (fp32, int8), streaming DiLoCo",
        },
    ),
    Topic(
        "Seeing the whole job: the timeline",
        "timeline.md",
        "Timeline of every rank",
        {
            "timeline": "4 gloo ranks, 30-60 ms slept in a random rank's random phase: how often "
            "the critical path names them, the clock alignment's error against a barrier, and "
            "the recording's cost, A/B interleaved",
        },
    ),
    Topic(
        "Verify: planted bugs and clean pairs",
        "verify.md",
        "Verify two runs",
        {
            "plant_and_catch": "phalanx verify on seven planted bugs (resume, strategy and world "
            "modes) and on clean pairs of every mode",
        },
    ),
    Topic(
        "Recovery from a killed rank",
        "recovery.md",
        "Restarts and live recovery",
        {
            "chaos_live_ddp_4ranks": "live recovery of a DDP job, 4 ranks: 20 runs, each "
            "SIGKILLing a random rank at a given phase, with and without a replacement",
            "chaos_live_exact_2ranks": "live-exact recovery, 2 ranks, 20 runs: the final "
            "parameters against a fault-free run's",
            "chaos_live_zero2_4ranks": "live recovery of a ZeRO-2 job, 4 ranks, 20 runs",
            "chaos_restart_4ranks": "the restart path (the whole job restarted), 4 ranks, 20 runs",
        },
    ),
)
OTHER = Topic("Other results", "index.md", "Home", {})
UNDESCRIBED = "not described yet (add the file's name to TOPICS in tools/bench_page.py)"


@dataclass
class Facts:
    """What a result's files record about how they were made."""

    commands: list[str] = field(default_factory=list)
    machine: str = NOT_RECORDED
    date: str = NOT_RECORDED
    same_as: str | None = None  # "same machine and session as X.txt"


_MACHINE = re.compile(r"\d+-core [^;]*?torch [\w.+]+")
_ISO_DATE = re.compile(r"\b(20\d\d-\d\d-\d\d)\b")
_DATE_OUTPUT = re.compile(r"^\w{3} (\w{3}) +(\d+) \d\d:\d\d:\d\d \w+ (\d{4})$")
_RUN_DIR = re.compile(r"^(phalanx bench \w+): results go to .*?-(\d{4})(\d\d)(\d\d)-\d{6}/?$")
_SAME_AS = re.compile(r"same machine and session as (\S+\.txt)")
_HIDDEN = re.compile(r"^\s*measured: |^RESULT \{")


def _header(lines: list[str]) -> list[str]:
    """The comment lines (``# ...``) at the top of a file."""
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    return header


def _commands(lines: list[str]) -> list[str]:
    shell = [line[2:].strip() for line in lines if line.startswith("$ ")]
    if shell:
        return shell
    commands = []
    for line in lines:
        text = line.lstrip("#").strip()
        if line.startswith("#") and re.match(r"(phalanx|python) ", text):
            # "CMD, three runs back to back" / "CMD   (2026-11-28, ...)": the note is not run
            commands.append(re.split(r", | {2,}\(", text, maxsplit=1)[0].strip())
    if commands:
        return commands
    for line in lines:
        if match := _RUN_DIR.match(line.strip()):
            return [f"{match.group(1)} (its options not recorded)"]
    return []


def _date(lines: list[str], header: list[str]) -> str:
    for line in header:
        if match := _ISO_DATE.search(line):
            return match.group(1)
    for line in lines:
        if match := _DATE_OUTPUT.match(line.strip()):
            month, day, year = match.groups()
            parsed = datetime.datetime.strptime(f"{year} {month} {day}", "%Y %b %d")
            return parsed.date().isoformat()
        if match := _RUN_DIR.match(line.strip()):
            return "-".join(match.groups()[1:])
    return NOT_RECORDED


def read_facts(text: str) -> Facts:
    """The command, machine and date one output file records."""
    lines = text.splitlines()
    header = _header(lines)
    facts = Facts(commands=_commands(lines), date=_date(lines, header))
    for line in header:
        if match := _MACHINE.search(line):
            facts.machine = match.group(0)
            break
    for line in header:
        if match := _SAME_AS.search(line):
            facts.same_as = match.group(1)
    return facts


def shown_output(text: str, limit: int = 80) -> str:
    """The output as the page shows it: no progress lines, no ``RESULT`` JSON."""
    lines = [line.rstrip() for line in text.splitlines() if not _HIDDEN.match(line)]
    while lines and not lines[-1]:
        lines.pop()
    if len(lines) > limit:
        lines = [*lines[:limit], f"... ({len(lines) - limit} more lines in the file)"]
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(out)


def _param_server(data: dict[str, Any]) -> str:
    rows = []
    for straggler, methods in data["runs"].items():
        for method, run in methods.items():
            to_target = run.get("time_to_target_s")
            rows.append(
                [
                    straggler,
                    method,
                    f"{run['updates_per_s']:.0f}",
                    "-" if to_target is None else f"{to_target:.2f}",
                    f"{run['final_acc']:.4f}",
                    str(run.get("max_staleness", "-")),
                ]
            )
    target = data.get("target", "the target")
    intro = (
        f"{data.get('updates', '?')} updates per run, worker steps padded to "
        f"{data.get('step_ms', '?')} ms (from `param_server.json`):"
    )
    header = ["straggler", "method", "updates/s", f"s to acc {target}", "final acc", "max stale"]
    return intro + "\n\n" + _table(header, rows)


def _low_bandwidth(data: dict[str, Any]) -> str:
    rows = [
        [
            method,
            f"{run['final_val_loss']:.4f}",
            f"{run['bytes_per_rank'] / 1e6:.1f}",
            f"{run['wall_s']:.1f}",
            f"{run['utilisation']:.2f}",
        ]
        for method, run in data["methods"].items()
    ]
    config = ", ".join(f"{key} {value}" for key, value in data.get("config", {}).items())
    intro = f"From `low_bandwidth.json` ({config}):"
    header = ["method", "val loss", "MB sent per rank", "wall s", "utilisation"]
    return intro + "\n\n" + _table(header, rows)


# The JSON files a table is made from, by result name; others are listed with their path.
JSON_TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "param_server": _param_server,
    "low_bandwidth": _low_bandwidth,
}


@dataclass
class Result:
    stem: str
    files: list[Path]
    facts: Facts

    def file(self, suffix: str) -> Path | None:
        return next((path for path in self.files if path.suffix == suffix), None)


def load_results(results: Path) -> dict[str, Result]:
    by_stem: dict[str, list[Path]] = {}
    for path in sorted(results.iterdir()):
        if path.suffix in (".txt", ".json", ".png"):
            by_stem.setdefault(path.stem, []).append(path)
    loaded = {}
    for stem, files in by_stem.items():
        txt = next((path for path in files if path.suffix == ".txt"), None)
        facts = read_facts(txt.read_text(encoding="utf-8")) if txt else Facts()
        loaded[stem] = Result(stem, files, facts)
    for result in loaded.values():  # "same machine and session as X.txt": X's machine and date
        source = loaded.get(Path(result.facts.same_as).stem) if result.facts.same_as else None
        if source is not None:
            note = f' (as `{result.facts.same_as}`, "same machine and session")'
            if result.facts.machine == NOT_RECORDED and source.facts.machine != NOT_RECORDED:
                result.facts.machine = source.facts.machine + note
            if result.facts.date == NOT_RECORDED and source.facts.date != NOT_RECORDED:
                result.facts.date = source.facts.date + note
    return loaded


def _section(result: Result, measures: str) -> tuple[list[str], dict[str, bytes]]:
    facts = result.facts
    files = ", ".join(f"`benchmarks/results/{path.name}`" for path in result.files)
    lines = [f"### {result.stem}", "", f"What it measures: {measures}.", ""]
    lines.append(f"- **Files:** {files}")
    if len(facts.commands) == 1:
        lines.append(f"- **Command:** `{facts.commands[0]}`")
    elif facts.commands:
        lines.append("- **Commands:**")
        lines += [f"    - `{command}`" for command in facts.commands]
    else:
        lines.append(f"- **Command:** {NOT_RECORDED}")
    lines += [f"- **Machine:** {facts.machine}", f"- **Date:** {facts.date}", ""]
    figures: dict[str, bytes] = {}
    png = result.file(".png")
    if png is not None:
        figures[png.name] = png.read_bytes()
        lines += [f"![{result.stem}]({FIGURES}/{png.name})", ""]
    json_path = result.file(".json")
    if json_path is not None and result.stem in JSON_TABLES:
        data = json.loads(json_path.read_text(encoding="utf-8"))
        lines += [JSON_TABLES[result.stem](data), ""]
    txt = result.file(".txt")
    if txt is not None:
        lines += ["```text", shown_output(txt.read_text(encoding="utf-8")), "```", ""]
    return lines, figures


_INTRO = """\
# Benchmarks

<!-- Generated by `python tools/bench_page.py` from benchmarks/results/; edit that script, not
this page. tests/docs/test_site.py fails when the page is out of date. -->

Every benchmark runs phalanx and its torch-native equivalent (DDP, FSDP,
ZeroRedundancyOptimizer, DCP, ...) **in the same invocation, interleaved**, and reports medians
and the ratio ours / torch: the machines these ran on have 2 cores and other work beside them,
so absolute times mean little and the ratios are what to compare. Byte counts are exact.

Run a suite with `phalanx bench SUITE` (`phalanx bench --help` lists the suites and their
flags); each run writes its rows and a JSON summary to a new `runs/bench-SUITE-<timestamp>/`.
The results below are the ones committed in `benchmarks/results/`, each with the command, the
machine and the date as its file records them ("not recorded" where the file does not say).
This page is generated from those files by `python tools/bench_page.py`.
"""


def render(results: Path = RESULTS) -> tuple[str, dict[str, bytes]]:
    """The page's Markdown and its figures (file name -> bytes)."""
    loaded = load_results(results)
    known = {stem for topic in TOPICS for stem in topic.stems}
    unknown = {stem: UNDESCRIBED for stem in loaded if stem not in known}
    other = Topic(OTHER.title, OTHER.guide, OTHER.guide_title, unknown)
    summary: list[list[str]] = []
    body: list[str] = []
    figures: dict[str, bytes] = {}
    for topic in (*TOPICS, other):
        present = [stem for stem in topic.stems if stem in loaded]
        if not present:
            continue
        guide = f"[{topic.guide_title}]({topic.guide})"
        body += [f"## {topic.title}", "", f"What these results mean: {guide}.", ""]
        for stem in present:
            lines, topic_figures = _section(loaded[stem], topic.stems[stem])
            body += lines
            figures.update(topic_figures)
            summary.append([f"[{stem}](#{stem})", topic.stems[stem], loaded[stem].facts.date])
    table = _table(["Result", "What it measures", "Date"], summary)
    page = "\n".join([_INTRO, table, "", *body]).rstrip() + "\n"
    return page, figures


def write(docs: Path = DOCS, results: Path = RESULTS, check: bool = False) -> list[str]:
    """Write (or with ``check``, compare) the page and its figures; returns what differed."""
    page, figures = render(results)
    wanted = {docs / PAGE: page.encode()}
    wanted.update({docs / FIGURES / name: data for name, data in figures.items()})
    figure_dir = docs / FIGURES
    stale = [p for p in figure_dir.glob("*") if p not in wanted] if figure_dir.is_dir() else []
    differ = [p for p, data in wanted.items() if not p.is_file() or p.read_bytes() != data]
    changed = [str(p.relative_to(docs.parent)) for p in [*differ, *stale]]
    if not check:
        figure_dir.mkdir(parents=True, exist_ok=True)
        for path in differ:
            path.write_bytes(wanted[path])
        for path in stale:
            path.unlink()
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only say whether it is up to date")
    args = parser.parse_args(argv)
    changed = write(check=args.check)
    if args.check and changed:
        print("out of date (run `python tools/bench_page.py`): " + ", ".join(changed))
        return 1
    print(("wrote " + ", ".join(changed)) if changed else f"docs/{PAGE} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
