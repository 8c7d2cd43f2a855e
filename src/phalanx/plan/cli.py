"""``phalanx plan``: model-state memory per device and communication per step, by strategy."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from phalanx.plan.memory import OPTIMIZERS, PRECISIONS, estimate

__all__ = ["main"]


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB" if x >= 1e8 else f"{x / 1e6:.1f} MB"


def main(argv: list[str]) -> int:
    """``phalanx plan --params 7.5e9 --dp 64 --optimizer adam --precision mixed [--json]``."""
    parser = argparse.ArgumentParser(prog="phalanx plan", description=__doc__)
    parser.add_argument("--params", type=float, required=True, help="parameter count, e.g. 7.5e9")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree N")
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--precision", default="mixed", choices=PRECISIONS)
    parser.add_argument("--json", action="store_true", help="print the estimates as JSON")
    args = parser.parse_args(argv)
    if args.params <= 0:
        parser.error(f"--params must be positive, got {args.params:g}")
    if args.dp < 1:
        parser.error(f"--dp must be >= 1, got {args.dp}")
    rows = estimate(args.params, args.dp, args.optimizer, args.precision)
    if args.json:
        print(json.dumps([{**asdict(r), "total": r.total} for r in rows]))
        return 0
    print(f"model states per device: {args.params:g} parameters, dp={args.dp}, "
          f"{args.optimizer}, {args.precision} precision")  # fmt: skip
    print(f"{'strategy':<9}{'params':>11}{'grads':>11}{'optimizer':>11}{'total':>11}"
          f"{'comm/step':>13}")  # fmt: skip
    for r in rows:
        print(f"{r.strategy:<9}{_gb(r.params):>11}{_gb(r.grads):>11}{_gb(r.optimizer):>11}"
              f"{_gb(r.total):>11}{r.comm_elements / args.params:>10.0f} Ψ")  # fmt: skip
    return 0
