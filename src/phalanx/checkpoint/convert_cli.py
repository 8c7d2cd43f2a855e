"""``phalanx checkpoint convert``: phalanx checkpoints to and from torch DCP and HF weights.

    phalanx checkpoint convert ckpt dcp_out --to dcp
    phalanx checkpoint convert ckpt hf_out --to hf [--max-shard-mb 2000]
    phalanx checkpoint convert dcp_in ckpt2 --from dcp [--step 100]
    phalanx checkpoint convert hf_in ckpt3 --from hf

One side is always a phalanx checkpoint (``SRC`` with ``--to``, ``DST`` with ``--from``); see
:func:`phalanx.checkpoint.to_dcp`, ``from_dcp``, ``to_hf``, ``from_hf``.
"""

from __future__ import annotations

import argparse
import sys

from phalanx.checkpoint.dcp_interop import from_dcp, to_dcp
from phalanx.checkpoint.errors import CheckpointError
from phalanx.checkpoint.hf_interop import from_hf, to_hf

__all__ = ["main"]

FORMATS = ("dcp", "hf")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx checkpoint convert")
    parser.add_argument("src", help="the checkpoint to read")
    parser.add_argument("dst", help="the directory to write")
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--to", choices=FORMATS, help="write SRC (phalanx) in this format")
    side.add_argument("--from", dest="source", choices=FORMATS, help="SRC's format (to phalanx)")
    parser.add_argument("--max-shard-mb", type=float, default=5000.0, help="--to hf: file size")
    parser.add_argument("--step", type=int, default=0, help="--from: the step to record")
    return parser


def _convert(args: argparse.Namespace) -> str:
    if args.to == "dcp":
        return str(to_dcp(args.src, args.dst))
    if args.to == "hf":
        if not args.max_shard_mb > 0:
            raise ValueError(f"--max-shard-mb must be > 0, got {args.max_shard_mb}")
        return str(to_hf(args.src, args.dst, max_shard_bytes=int(args.max_shard_mb * 1e6)))
    if args.source == "dcp":
        return str(from_dcp(args.src, args.dst, step=args.step))
    return str(from_hf(args.src, args.dst, step=args.step))


def main(argv: list[str]) -> int:
    """``phalanx checkpoint convert ...``; returns the exit code (2 for a bad command line or
    checkpoint, with the reason on stderr)."""
    if not argv or argv[0] != "convert":
        print("usage: phalanx checkpoint convert SRC DST (--to | --from) {dcp,hf}", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv[1:])
    try:
        print(f"wrote {_convert(args)}")
    except (CheckpointError, ValueError, TypeError) as exc:
        print(f"phalanx checkpoint convert: error: {exc}", file=sys.stderr)
        return 2
    return 0
