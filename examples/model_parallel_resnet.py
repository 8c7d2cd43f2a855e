"""Seed 001 §4's ModelParallelResNet50, smaller: a ResNet split over two devices in one process.

    python examples/model_parallel_resnet.py             # trains, prints the loss
    python examples/model_parallel_resnet.py --profile   # and traces it with torch.profiler

The seed cuts ResNet50 by hand (``seq1`` on cuda:0, ``seq2`` and ``fc`` on cuda:1, copying the
activation across in ``forward``). Here the same layer chain, sized for scikit-learn's 8x8
digits (they ship with scikit-learn: no download), is cut by ``split_across_devices``, which
balances the parameter counts and copies activations across; autograd carries gradients back.
With two GPUs the parts go to cuda:0 and cuda:1; otherwise both "devices" are the CPU, which runs
the same code path. Unlike the seed (random data, ``MSELoss`` on one-hot labels) it trains on
real images with cross-entropy, so the loss visibly falls.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from phalanx._optional import require
from phalanx.model_parallel import split_across_devices
from phalanx.models import small_resnet

require("examples", "examples/model_parallel_resnet.py")  # scikit-learn (digits), checked first


def two_devices() -> list[str]:
    """cuda:0 and cuda:1 when there are two GPUs, else the CPU twice (same code path)."""
    return ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cpu", "cpu"]


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    import phalanx.datasets

    x, y = phalanx.datasets.digits()  # scikit-learn's, without importing scikit-learn
    images = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    return images, torch.tensor(y, dtype=torch.int64)


def profiler(enabled: bool, trace_dir: str) -> torch.profiler.profile | None:
    """The seed's profiler settings: skip 1 step, warm up 1, record 2, write one trace."""
    if not enabled:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir),
        record_shapes=True,
        profile_memory=False,  # the seed notes True takes minutes
    )


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = split_across_devices(small_resnet(), two_devices())
    print(model.describe())
    images, labels = digits()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    prof = profiler(args.profile, args.trace_dir)
    if prof is not None:
        prof.start()
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(args.steps):
        batch = torch.randint(0, len(labels), (args.batch_size,), generator=g)
        optimizer.zero_grad()
        outputs = model(images[batch])  # moved to the first device by the model
        loss = loss_fn(outputs, labels[batch].to(outputs.device))
        loss.backward()  # gradients flow back across the device boundary
        optimizer.step()
        losses.append(loss.item())
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step: {step}, loss: {losses[-1]:.4f}")
        if prof is not None:
            prof.step()  # the seed: don't forget to step the profiler
    k = min(5, len(losses))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"mean loss of the first {k} steps {first:.4f}, of the last {k} steps {last:.4f}")
    if prof is not None:
        prof.stop()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
        print(f"trace written to {args.trace_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="trace with torch.profiler")
    parser.add_argument("--trace-dir", default="./result", help="where --profile writes")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
