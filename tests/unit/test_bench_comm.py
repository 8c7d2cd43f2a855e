"""``phalanx bench comm``: flags, sizes, statistics, bus bandwidth, table; one quick real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.bench import comm
from phalanx.bench.comm import (
    BenchArgsError,
    Row,
    busbw_factor,
    format_bytes,
    format_table,
    parse_args,
    parse_bytes,
    percentile,
    size_list,
    summarize,
)

MiB = 1 << 20


def test_defaults() -> None:
    cfg = parse_args([])
    assert cfg.world_size == 2
    assert cfg.ops == ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
    assert cfg.sizes[0] == 4 and cfg.sizes[-1] == 64 * MiB
    assert {4096, MiB, 16 * MiB} <= set(cfg.sizes)
    assert (cfg.iters, cfg.warmup, cfg.dtype, cfg.json_path) == (20, 3, "float32", None)


def test_quick_is_small_unless_told_otherwise() -> None:
    cfg = parse_args(["--quick"])
    assert cfg.sizes[-1] == MiB and len(cfg.sizes) <= 6
    assert (cfg.iters, cfg.warmup) == (5, 1)
    cfg = parse_args(["--quick", "--iters", "9", "--max-bytes", "4KiB", "--ops", "broadcast"])
    assert (cfg.iters, cfg.sizes[-1], cfg.ops) == (9, 4096, ("broadcast",))


def test_flags() -> None:
    cfg = parse_args(
        [
            "--world-size",
            "3",
            "--ops",
            "all_reduce, broadcast",
            "--min-bytes",
            "1K",
            "--max-bytes",
            "16KiB",
            "--warmup",
            "0",
            "--dtype",
            "bfloat16",
            "--json",
            "x.json",
        ]
    )
    assert cfg.world_size == 3 and cfg.ops == ("all_reduce", "broadcast")
    assert cfg.sizes == (1024, 4096, 16384)
    assert (cfg.warmup, cfg.dtype, cfg.json_path) == (0, "bfloat16", "x.json")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--world-size", "0"], ["--world-size", "0"]),
        (["--iters", "0"], ["--iters", "0"]),
        (["--warmup", "-1"], ["--warmup", "-1"]),
        (["--ops", "all_reduce,scatter"], ["--ops", "'scatter'"]),
        (["--ops", ""], ["--ops"]),
        (["--dtype", "float8"], ["--dtype", "'float8'"]),
        (["--min-bytes", "lots"], ["--min-bytes", "'lots'"]),
        (["--max-bytes", "0"], ["--max-bytes", "'0'"]),
        (["--min-bytes", "1MiB", "--max-bytes", "4KiB"], ["--min-bytes", "1MiB", "4096"]),
        (["--iters", "many"], ["--iters", "'many'"]),
        (["--frobnicate"], ["--frobnicate"]),
    ],
)
def test_bad_flags_name_the_flag_and_value(argv: list[str], names: list[str]) -> None:
    with pytest.raises(BenchArgsError) as err:
        parse_args(argv)
    for name in names:
        assert name in str(err.value)


def test_main_reports_bad_flags_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert comm.main(["--world-size", "-2"]) == 2
    assert "--world-size -2" in capsys.readouterr().err


def test_parse_bytes_units() -> None:
    assert [parse_bytes("--x", v) for v in ("4", "4b", "1k", "1KiB", "64MiB", "1G")] == [
        4,
        4,
        1024,
        1024,
        64 * MiB,
        1 << 30,
    ]


def test_size_list() -> None:
    assert size_list(4, 64 * MiB, 16) == [4, 64, 1024, 16384, 262144, 4 * MiB, 64 * MiB]
    assert size_list(4, 4096) == [4, 16, 64, 256, 1024, 4096]
    assert size_list(1000, 5000) == [1000, 4000, 5000]
    assert size_list(8, 8) == [8]
    with pytest.raises(ValueError, match="min_bytes=9, max_bytes=8"):
        size_list(9, 8)


def test_busbw_factors_follow_nccl_tests() -> None:
    assert busbw_factor("all_reduce", 2) == 1.0
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("reduce_scatter", 4) == 0.75
    assert busbw_factor("all_gather", 2) == 0.5
    assert busbw_factor("broadcast", 8) == 1.0
    with pytest.raises(ValueError, match="'gather'"):
        busbw_factor("gather", 2)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0], 90) == 10.0
    assert percentile([5.0], 90) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize_computes_bandwidth_and_ratio_to_native() -> None:
    records = [
        {"op": "all_reduce", "bytes": 4_000_000, "impl": "native", "times": [0.004, 0.002, 0.003]},
        {"op": "all_reduce", "bytes": 4_000_000, "impl": "ring", "times": [0.0015, 0.0015, 0.01]},
        {"op": "all_gather", "bytes": 1_000_000, "impl": "native", "times": [0.001]},
    ]
    native, ring, gather = summarize(records, world=4)
    assert native.p50_us == pytest.approx(3000) and native.algbw_gbps == pytest.approx(4 / 3)
    assert native.busbw_gbps == pytest.approx(4 / 3 * 1.5) and native.vs_native == 1.0
    assert ring.p50_us == pytest.approx(1500) and ring.p90_us == pytest.approx(8300)
    assert ring.busbw_gbps == pytest.approx(4.0) and ring.vs_native == pytest.approx(2.0)
    assert gather.busbw_gbps == pytest.approx(0.75)


def test_rotation_interleaves_without_fixed_neighbours() -> None:
    orders = [comm._rotated(3, i) for i in range(3)]
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]


def test_format_bytes_and_table() -> None:
    assert [format_bytes(n) for n in (4, 1024, 3000, 64 * MiB)] == [
        "4 B",
        "1 KiB",
        "3000 B",
        "64 MiB",
    ]
    rows = [
        Row("all_reduce", 4096, "native", 512.25, 900.0, 0.008, 0.008, 1.0),
        Row("all_reduce", 4096, "ring", 1024.5, 2000.0, 0.004, 0.004, 0.5),
    ]
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["op", "size", "impl"] and "vs native" in lines[0]
    assert lines[2].split() == [
        "all_reduce",
        "4",
        "KiB",
        "ring",
        "1024.5",
        "2000.0",
        "0.004",
        "0.004",
        "0.50x",
    ]
    assert len({len(line) for line in lines}) == 1, "columns are aligned"


@pytest.mark.extended
def test_quick_run_end_to_end(tmp_path: Path) -> None:
    out = f"{tmp_path}/bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx.bench.comm",
            "--quick",
            "--max-bytes",
            "64KiB",
            "--iters",
            "3",
            "--json",
            out,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    result = json.loads(last[len("RESULT ") :])
    with open(out) as f:
        assert json.load(f) == result
    assert result["config"]["world_size"] == 2
    rows = result["rows"]
    impls = {(r["op"], r["impl"]) for r in rows}
    assert impls == {
        ("all_reduce", "native"),
        ("all_reduce", "ring"),
        ("all_reduce", "tree"),
        ("reduce_scatter", "native"),
        ("reduce_scatter", "ring"),
        ("all_gather", "native"),
        ("all_gather", "ring"),
        ("broadcast", "native"),
        ("broadcast", "tree"),
        ("broadcast", "ring"),
    }
    assert all(r["p50_us"] > 0 and r["busbw_gbps"] > 0 for r in rows)
    assert all(r["vs_native"] == 1.0 for r in rows if r["impl"] == "native")
    assert "busbw GB/s" in proc.stdout
    # without --out: a new directory under runs/, each size's rows printed as measured
    (run_dir,) = (tmp_path / "runs").glob("bench-comm-*")
    assert json.loads((run_dir / "comm.json").read_text()) == result
    streamed = [json.loads(line) for line in (run_dir / "rows.jsonl").read_text().splitlines()]
    assert streamed == rows
    assert proc.stdout.count("measured: op=") == len(rows)
    assert proc.stdout.index("measured: op=") < proc.stdout.index("busbw GB/s")
