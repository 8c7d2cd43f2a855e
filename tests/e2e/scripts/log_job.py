"""A tiny Job that logs two steps; ``--quiet`` first sets the "phalanx" logger to ERROR.

Usage: log_job.py [--quiet] [--basic-config]. Prints ``DONE`` at the end.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import phalanx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quiet", action="store_true", help='"phalanx" logger at ERROR')
    parser.add_argument("--basic-config", action="store_true", help="logging.basicConfig(INFO)")
    args = parser.parse_args()
    if args.quiet:
        logging.getLogger("phalanx").setLevel(logging.ERROR)
    if args.basic_config:
        logging.basicConfig(level=logging.INFO, format="APP %(name)s %(message)s")
    job = phalanx.Job()
    net = nn.Linear(4, 2)
    model, optimizer = job.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert optimizer is not None
    for x in job.progress(torch.randn(2, 8, 4)):
        job.backward(model(x).pow(2).mean())
        job.step(optimizer)
        job.log(loss=1.5)
    job.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
