"""The phalanx demo: a small CNN on scikit-learn's handwritten digits, data parallel.

    phalanx run --standalone --nproc-per-node 2 examples/digits.py      # `make demo`
    phalanx run --standalone --nproc-per-node 3 examples/digits.py --strategy ps-async
    phalanx run --standalone --nproc-per-node 3 examples/digits.py --strategy ssp --staleness 2 \
        --straggler 1:4

Real 8x8 handwritten digits that ship with scikit-learn (no download). Progress bar on rank 0,
metrics averaged over the ranks, a checkpoint every epoch; run it again and it resumes from the
newest checkpoint. Ends with a summary: test accuracy, samples/s, share of time communicating.
With a parameter-server strategy rank 0 serves (and prints the staleness histogram), the other
ranks train; parameter servers do not checkpoint.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import phalanx
from phalanx._optional import require

require("examples", "examples/digits.py")  # scikit-learn (digits), checked first


def digits_datasets(seed: int = 0) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    from phalanx.datasets import digits

    x, y = digits()  # scikit-learn's, without importing scikit-learn
    images = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    train, test = order[:1437], order[1437:]
    ds = torch.utils.data.TensorDataset
    return ds(images[train], labels[train]), ds(images[test], labels[test])


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.utils.data.Dataset) -> tuple[float, float]:
    model.eval()
    x, y = data.tensors  # type: ignore[attr-defined]
    logits = model(x)
    model.train()
    loss = nn.functional.cross_entropy(logits, y).item()
    return loss, (logits.argmax(1) == y).float().mean().item()


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--strategy",
        default="ddp",
        help="ddp, torch-ddp, dp, single, ps-sync, ps-async, ssp, hogwild",
    )
    parser.add_argument("--staleness", type=int, default=None, help="SSP bound (strategy ssp)")
    parser.add_argument(
        "--straggler", default=None, help="WHO:FACTOR, e.g. 1:4 (worker 1 4x slower) or random:4"
    )
    parser.add_argument("--checkpoint-dir", default="runs/digits")
    parser.add_argument(
        "--precision", default="fp32", help="fp32, bf16-mixed, fp16-mixed or bf16-true"
    )
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="seeds torch, numpy, random")
    args = parser.parse_args(argv)

    ps = args.strategy in ("ps-sync", "ps-async", "ssp")
    strategy: str | phalanx.train.Strategy = args.strategy  # a preset name
    if ps:  # the parameter-server presets, with the staleness bound
        mode = {"ps-sync": "sync", "ps-async": "async", "ssp": "ssp"}[args.strategy]
        strategy = phalanx.PS(mode=mode, staleness=args.staleness)
    job = phalanx.Job(
        strategy,
        precision=args.precision,
        grad_accum=args.grad_accum,
        seed=args.seed,
        checkpoint_dir=None if ps else args.checkpoint_dir,
    )
    if args.straggler is not None:
        job.slow_down(*_straggler(args.straggler))
    with phalanx.main_first():  # rank 0 loads (and caches) the data set first
        train_set, test_set = digits_datasets()
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer = job.setup(model, optimizer)
    loader = job.loader(train_set, batch_size=args.batch_size, shuffle=True)
    for _ in job.epochs(args.epochs):
        total, batches = 0.0, 0
        for x, y in job.progress(loader):
            loss = nn.functional.cross_entropy(model(x), y)
            job.backward(loss)
            job.step()
            total, batches = total + loss.item(), batches + 1
        test_loss, accuracy = evaluate(model, test_set)
        job.log(train_loss=total / max(batches, 1), test_loss=test_loss, accuracy=accuracy)
        if not ps:
            job.save()
    _, accuracy = evaluate(model, test_set)
    summary = job.summary()
    if job.is_server and job.server_report is not None:
        r = job.server_report
        print(
            f"done: test accuracy {100 * accuracy:.2f}% | server applied {r.applied} gradients "
            f"in {r.seconds:.1f} s ({r.applied / max(r.seconds, 1e-9):.0f}/s) | staleness "
            f"histogram {r.staleness} | lost workers {sorted(r.lost) or 'none'}"
        )
    elif job.world.is_main and summary["train_seconds"] == 0:
        print(
            f"nothing left to train: all {args.epochs} epochs are in {args.checkpoint_dir}; "
            f"test accuracy {100 * accuracy:.2f}% (delete the directory to start over)"
        )
    elif job.world.is_main:
        print(
            f"done: test accuracy {100 * accuracy:.2f}% | {summary['samples_per_s']:.0f} samples/s"
            f" | {100 * summary['comm_share']:.1f}% of step time waiting for communication"
            f" | checkpoints in {args.checkpoint_dir}"
        )
    job.close()
    return accuracy


def _straggler(spec: str) -> tuple[int | str, float]:
    who, _, factor = spec.partition(":")
    return (who if who == "random" else int(who), float(factor or 2.0))


if __name__ == "__main__":
    main()
