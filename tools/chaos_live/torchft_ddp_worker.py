"""One torchft replica group (one process, gloo on CPU) for ``torchft_baseline.py``.

Follows the structure of torchft's DDP example, ``train_ddp.py`` of pytorch/torchft (read at
commit 73dafea, 2025-10-21, the example that matches the 0.2.0 wheel's API): a
``torchft.DistributedSampler`` over the replica groups, ``ProcessGroupGloo(timeout=5 s)``,
``PGTransport`` for live healing, ``Manager(min_replica_size=1, timeout=30 s)``, the same small
CNN with its "useless" embedding, ``torchft.DistributedDataParallel`` and ``torchft.Optimizer``
over AdamW, and the ``zero_grad`` / forward / ``backward`` / ``step`` loop. Differences, all
for a 2-core CPU box without network: random tensors of CIFAR-10's shape instead of CIFAR-10,
``DataLoader(num_workers=0)`` instead of torchdata's ``StatefulDataLoader``, an embedding of
``--embedding-rows`` rows instead of 1 GB, no profiler, a per-group ``TCPStore`` hosted here
(torchrun hosts it in the example), and a stop step read from ``--stop-file`` instead of 10000.

Every committed step appends a JSON line ``{"t", "step", "participants", "quorum"}`` to
``<out-dir>/group<G>.<pid>.jsonl``; at the stop step the parameters go to ``final.<G>.<pid>.pt``.
Runs only in a venv with torchft (see ``make_torchft_venv.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import IO

import torch
from torch import nn, optim
from torch.distributed import TCPStore
from torch.utils.data import DataLoader, TensorDataset
from torchft import (
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    Optimizer,
    ProcessGroupGloo,
)
from torchft.checkpointing.pg_transport import PGTransport

BATCH = 64  # as in train_ddp.py
FINAL_DIM = 10


class Net(nn.Module):
    """train_ddp.py's CNN: two conv blocks, an MLP head and a large unused embedding."""

    def __init__(self, embedding_rows: int) -> None:
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(3, 6, 5),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
        )
        # Only its first row is used: it makes the gradient all-reduce large, as in the example.
        self.useless = nn.Embedding(embedding_rows, FINAL_DIM)
        self.classifier = nn.Sequential(
            nn.Linear(16 * 5 * 5, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, FINAL_DIM),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.cnn(x), 1)
        return self.classifier(x) + self.useless.weight[0]


def random_cifar(samples: int) -> TensorDataset:
    """CIFAR-10-shaped random data, the same on every replica group."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(samples, 3, 32, 32, generator=gen)
    return TensorDataset(images, torch.randint(0, FINAL_DIM, (samples,), generator=gen))


def stop_step(path: Path) -> int | None:
    """The step the driver asked the job to end at, once it has written it."""
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def log(out: IO[str], **fields: object) -> None:
    out.write(json.dumps(fields) + "\n")
    out.flush()


def build(args: argparse.Namespace) -> tuple[Manager, nn.Module, Optimizer, TCPStore]:
    """The example's Manager, DDP model and wrapped optimizer, for one 1-process group."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    net = Net(args.embedding_rows)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    transport = PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu"))
    holder: dict[str, nn.Module | optim.Optimizer] = {}

    def load_state_dict(state: dict[str, dict[str, object]]) -> None:
        holder["model"].load_state_dict(state["model"])
        holder["optim"].load_state_dict(state["optim"])

    def state_dict() -> dict[str, dict[str, object]]:
        return {"model": holder["model"].state_dict(), "optim": holder["optim"].state_dict()}

    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{args.group}",
        timeout=timedelta(seconds=30),
        checkpoint_transport=transport,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname="127.0.0.1",
    )
    model = DistributedDataParallel(manager, net)
    optimizer = Optimizer(manager, optim.AdamW(model.parameters()))
    holder.update(model=model, optim=optimizer)
    return manager, model, optimizer, store


def train(args: argparse.Namespace, out: IO[str]) -> None:
    manager, model, optimizer, _store = build(args)
    dataset = random_cifar(BATCH * args.num_groups * 16)
    sampler = DistributedSampler(
        dataset,
        replica_rank=args.group,
        num_replica_groups=args.num_groups,
        group_rank=0,
        num_replicas=1,
        shuffle=True,
    )
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=0, sampler=sampler)
    criterion = nn.CrossEntropyLoss()
    log(out, event="ready", t=time.time(), step=manager.current_step())
    while True:
        for inputs, labels in loader:
            before = manager.current_step()
            optimizer.zero_grad()
            loss = criterion(model(inputs), labels)
            loss.backward()
            optimizer.step()
            step = manager.current_step()
            if step > before:
                quorum = manager._quorum_id  # no public accessor in 0.2.0
                live = manager.num_participants()
                log(out, t=time.time(), step=step, participants=live, quorum=quorum)
            stop = stop_step(args.stop_file)
            if stop is not None and step >= stop:
                final = {k: v.detach().clone() for k, v in model.state_dict().items()}
                torch.save(final, args.out_dir / f"final.{args.group}.{os.getpid()}.pt")
                log(out, event="done", t=time.time(), step=step)
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--num-groups", type=int, required=True)
    parser.add_argument("--lighthouse", required=True, help="http://127.0.0.1:PORT")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--embedding-rows", type=int, default=250_000)
    args = parser.parse_args()
    path = args.out_dir / f"group{args.group}.{os.getpid()}.jsonl"
    with path.open("a") as out:
        log(out, event="start", t=time.time(), pid=os.getpid())
        train(args, out)
    # torchft's manager threads can keep a finished process alive: leave as the example's exit().
    os._exit(0)


if __name__ == "__main__":
    main()
