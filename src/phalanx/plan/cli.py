"""``phalanx plan``: memory per device and communication per step, by strategy.

    phalanx plan --params 7.5e9 --dp 64 [--optimizer adam] [--precision fp16-master] [--json]
    phalanx plan SCRIPT.py --batch-size 16 --dp 4 [--device-memory 16GB] [--json]
        [--activation-checkpointing full|selective [--checkpoint-every K]]

With ``--params``, model states from the ZeRO paper's formulas for Ψ parameters. With a script,
Ψ and the activations of one micro-batch are measured on the script's real model: the script
defines ``build_model()`` and ``example_batch(batch_size)`` (optionally ``loss_fn(output,
batch)``), and is imported without running its ``__main__`` block. Activations are what one
forward holds for backward (temporaries excluded), measured in the model's own dtype; with
``--activation-checkpointing``, what the checkpointed model holds (and, beside it, what it
would hold without). ``--device-memory`` then recommends the strategy with the least
communication that fits.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

import torch

from phalanx.activation_checkpointing import ActivationCheckpointing, checkpoint_activations
from phalanx.plan.fit import Recommendation, device_total, parse_size, recommend
from phalanx.plan.measure import activation_bytes, load_script, parameter_count
from phalanx.plan.memory import OPTIMIZERS, StrategyEstimate, estimate
from phalanx.precisions import check_precision

__all__ = ["main"]

ACTIVATION_NOTE = (
    "activations = what one forward of one micro-batch holds for backward, "
    "excluding temporaries and backward-pass buffers"
)
# The precision of a model built in each dtype, in the names of phalanx.precisions.
_PRECISION_OF_DTYPE = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16-true",
    torch.float16: "fp16-master",
}


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB" if x >= 1e8 else f"{x / 1e6:.1f} MB"


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:  # argparse reports it as "argument --device-memory: ..."
        raise argparse.ArgumentTypeError(str(e)) from None


def _precision(text: str) -> str:
    try:
        return check_precision("--precision", text)
    except ValueError as e:  # argparse reports it as "argument --precision: ..."
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx plan", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "script",
        nargs="?",
        help="training script defining build_model() and example_batch(batch_size)",
    )
    parser.add_argument("--params", type=float, help="parameter count, e.g. 7.5e9 (no script)")
    parser.add_argument("--batch-size", type=int, help="micro-batch per rank (with a script)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree N")
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    parser.add_argument(
        "--precision",
        type=_precision,
        help="fp32, bf16-mixed, fp16-mixed, bf16-true or fp16-master (phalanx.precisions); "
        "default: fp16-master, with a script the model's dtype",
    )
    parser.add_argument(
        "--device-memory", type=_size, metavar="SIZE", help="per device, e.g. 16GB, 16GiB, 512MB"
    )
    parser.add_argument(
        "--activation-checkpointing",
        choices=ActivationCheckpointing.modes,
        help="measure the activations with the model's blocks checkpointed (with a script)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=1,
        metavar="K",
        help="with --activation-checkpointing: every K-th block only (default 1)",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if (args.script is None) == (args.params is None):
        parser.error("give either a script or --params N, not both or neither")
    if args.params is not None and args.params <= 0:
        parser.error(f"--params must be positive, got {args.params:g}")
    if args.dp < 1:
        parser.error(f"--dp must be >= 1, got {args.dp}")
    if args.script is None:
        for flag, value in (
            ("--batch-size", args.batch_size),
            ("--device-memory", args.device_memory),
            ("--activation-checkpointing", args.activation_checkpointing),
        ):
            if value is not None:
                parser.error(f"{flag} needs a script (it measures activations), not --params")
    elif args.batch_size is None or args.batch_size < 1:
        parser.error(f"a script needs --batch-size >= 1, got {args.batch_size}")
    if args.checkpoint_every < 1:
        parser.error(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")


def main(argv: list[str]) -> int:
    """``phalanx plan``: see the module docstring; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    if args.script is None:
        return _plan_params(args)
    return _plan_script(parser, args)


def _plan_params(args: argparse.Namespace) -> int:
    precision = args.precision or "fp16-master"
    rows = estimate(args.params, args.dp, args.optimizer, precision)
    if args.json:
        print(json.dumps([{**asdict(r), "total": r.total} for r in rows]))
        return 0
    print(
        f"model states per device: {args.params:g} parameters, dp={args.dp}, "
        f"{args.optimizer}, {precision} precision"
    )
    print(
        f"{'strategy':<9}{'params':>11}{'grads':>11}{'optimizer':>11}{'total':>11}{'comm/step':>13}"
    )
    for r in rows:
        print(
            f"{r.strategy:<9}{_gb(r.params):>11}{_gb(r.grads):>11}{_gb(r.optimizer):>11}"
            f"{_gb(r.total):>11}{r.comm_elements / args.params:>10.0f} Ψ"
        )
    return 0


def _measure(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """Load the script, build its model and measure Ψ, dtype and activation bytes."""
    try:
        script = load_script(args.script)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    model = script.build_model()
    if not isinstance(model, torch.nn.Module):
        parser.error(
            f"{args.script}: build_model() must return an nn.Module, got {type(model).__name__}"
        )
    batch = script.example_batch(args.batch_size)
    if not isinstance(batch, tuple | list):
        batch = (batch,)
    psi = parameter_count(model)
    if psi == 0:
        parser.error(f"{args.script}: build_model() returned a model without parameters")
    dtype = next(model.parameters()).dtype
    activations = activation_bytes(model, batch, script.loss_fn)
    without = None
    if args.activation_checkpointing is not None:
        policy = ActivationCheckpointing(args.activation_checkpointing, args.checkpoint_every)
        try:
            checkpoint_activations(model, policy)
        except ValueError as e:
            parser.error(f"{args.script}: {e}")
        without, activations = activations, activation_bytes(model, batch, script.loss_fn)
    native = _PRECISION_OF_DTYPE.get(dtype, "fp32")  # the precision the model was built in
    return {
        "params": psi,
        "dtype": str(dtype).removeprefix("torch."),
        "native_precision": native,
        "precision": args.precision or native,
        "activation_bytes": activations,
        "activation_checkpointing": args.activation_checkpointing,
        "activation_bytes_without_checkpointing": without,
    }


def _plan_script(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    m = _measure(parser, args)
    rows = estimate(m["params"], args.dp, args.optimizer, m["precision"])
    act = m["activation_bytes"]
    fit = None if args.device_memory is None else recommend(rows, act, args.device_memory)
    if args.json:
        print(json.dumps(_as_json(args, m, rows, fit)))
        return 0
    print(
        f"phalanx plan {args.script}: {m['params']:,} parameters (Ψ), {m['dtype']}; "
        f"dp={args.dp}, {args.optimizer}, {m['precision']} precision"
    )
    checkpointed = ""
    if m["activation_checkpointing"] is not None:
        every = f", every {args.checkpoint_every}" if args.checkpoint_every > 1 else ""
        without = _gb(m["activation_bytes_without_checkpointing"])
        checkpointed = f", {m['activation_checkpointing']} checkpointing{every}: {without} without"
    print(
        f"activations: {_gb(act)} per device for a micro-batch of {args.batch_size} "
        f"(measured in {m['dtype']}{checkpointed})"
    )
    print(f"  ({ACTIVATION_NOTE})")
    if m["precision"] != m["native_precision"]:
        print(
            f"  note: activations are {m['dtype']}, not measured under {m['precision']} precision"
        )
    print(
        f"{'strategy':<9}{'params':>10}{'grads':>10}{'optimizer':>11}{'states':>10}"
        f"{'activations':>13}{'total':>10}{'comm/step':>11}"
    )
    for r in rows:
        print(
            f"{r.strategy:<9}{_gb(r.params):>10}{_gb(r.grads):>10}{_gb(r.optimizer):>11}"
            f"{_gb(r.total):>10}{_gb(act):>13}{_gb(device_total(r, act)):>10}"
            f"{r.comm_elements / m['params']:>9.0f} Ψ"
        )
    if fit is not None:
        print(_fit_line(fit))
    return 0


def _fit_line(fit: Recommendation) -> str:
    budget = f"{_gb(fit.budget)} per device"
    if fit.strategy is not None:
        return (
            f"recommended for {budget}: {fit.strategy} (needs {_gb(fit.needed)}; "
            "the least communication that fits)"
        )
    return (
        f"nothing fits in {budget}: the smallest, {fit.smallest}, needs {_gb(fit.needed)}, "
        f"{_gb(fit.shortfall)} too much"
    )


def _as_json(
    args: argparse.Namespace,
    m: dict[str, Any],
    rows: list[StrategyEstimate],
    fit: Recommendation | None,
) -> dict[str, Any]:
    strategies = [
        {
            **asdict(r),
            "model_states": r.total,
            "activations": m["activation_bytes"],
            "total": device_total(r, m["activation_bytes"]),
        }
        for r in rows
    ]
    recommendation = None
    if fit is not None:
        recommendation = {**asdict(fit), "shortfall": fit.shortfall}
    return {
        "script": args.script,
        **m,
        "batch_size": args.batch_size,
        "dp": args.dp,
        "optimizer": args.optimizer,
        "activation_note": ACTIVATION_NOTE,
        "device_memory": args.device_memory,
        "strategies": strategies,
        "recommendation": recommendation,
    }
