"""Horovod's pytorch_mnist.py example on scikit-learn's 8x8 digits.

Only the import line differs from a Horovod script: ``import phalanx.horovod as hvd`` instead
of ``import horovod.torch as hvd``; launch with ``phalanx run --nproc-per-node 2`` instead of
``horovodrun -np 2``.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import phalanx.horovod as hvd

# Training settings
parser = argparse.ArgumentParser(description="PyTorch digits example")
parser.add_argument(
    "--batch-size",
    type=int,
    default=32,
    metavar="N",
    help="input batch size for training (default: 32)",
)
parser.add_argument(
    "--test-batch-size",
    type=int,
    default=200,
    metavar="N",
    help="input batch size for testing (default: 200)",
)
parser.add_argument(
    "--epochs", type=int, default=10, metavar="N", help="number of epochs to train (default: 10)"
)
parser.add_argument(
    "--lr", type=float, default=0.05, metavar="LR", help="learning rate (default: 0.05)"
)
parser.add_argument(
    "--momentum", type=float, default=0.9, metavar="M", help="SGD momentum (default: 0.9)"
)
parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed (default: 42)")
parser.add_argument(
    "--log-interval",
    type=int,
    default=10,
    metavar="N",
    help="how many batches to wait before logging training status",
)
parser.add_argument(
    "--fp16-allreduce",
    action="store_true",
    default=False,
    help="use fp16 compression during allreduce",
)
parser.add_argument(
    "--gradient-predivide-factor",
    type=float,
    default=1.0,
    help="apply gradient predivide factor in optimizer (default: 1.0)",
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x):
        x = x.view(-1, 64)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return F.log_softmax(x, dim=1)


def digits_datasets():
    digits = load_digits()
    images = digits.images.reshape(-1, 1, 8, 8) / 16.0
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.25, random_state=0, stratify=digits.target
    )

    def dataset(x, y):
        return torch.utils.data.TensorDataset(
            torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)
        )

    return dataset(x_train, y_train), dataset(x_test, y_test)


def main(args):
    def train_epoch(epoch):
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                # Horovod: use train_sampler to determine the number of examples in
                # this worker's partition.
                seen, percent = batch_idx * len(data), 100.0 * batch_idx / len(train_loader)
                print(
                    f"Train Epoch: {epoch} [{seen}/{len(train_sampler)} ({percent:.0f}%)]"
                    f"\tLoss: {loss.item():.6f}"
                )

    def metric_average(val, name):
        tensor = torch.tensor(val)
        avg_tensor = hvd.allreduce(tensor, name=name)
        return avg_tensor.item()

    def test():
        model.eval()
        test_loss = 0.0
        test_accuracy = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                # sum up batch loss
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                # get the index of the max log-probability
                pred = output.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.view_as(pred)).float().sum().item()

        # Horovod: use test_sampler to determine the number of examples in
        # this worker's partition.
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)

        # Horovod: average metric values across workers.
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")

        # Horovod: print output only on first rank.
        if hvd.rank() == 0:
            print(
                f"\nTest set: Average loss: {test_loss:.4f}, "
                f"Accuracy: {100.0 * test_accuracy:.2f}%\n"
            )
        return test_accuracy

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    train_dataset, test_dataset = digits_datasets()
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler
    )
    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False
    )
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler
    )

    model = Net()

    # Horovod: scale learning rate by the number of workers.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

    for epoch in range(1, args.epochs + 1):
        train_epoch(epoch)
    accuracy = test()
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.3f}")
    hvd.shutdown()


if __name__ == "__main__":
    main(parser.parse_args())
