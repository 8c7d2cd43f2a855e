"""torch's DDP over gloo, no ``import phalanx``, with its exit arranged to hit torch's exit race.

    ddp_exit_race.py DIR [finish|abort|raise]

DIR is a directory both ranks share. The training is plain torch DDP. Then each rank starts one
last all-reduce from a gradient hook, as DDP's own all-reduces start: the work holds the
backward's thread-local state, a Python object, so gloo's thread needs the GIL to destroy it.
Rank 0 drops its handle unwaited, so gloo's thread holds the last reference. Rank 0's last exit
handlers keep the GIL (calls into libc through ``ctypes.PyDLL``, which do not release it, and
no Python code in between that could hand it over) until rank 1 has seen the all-reduce
complete, and 20 ms more. So gloo's thread is still waiting for the GIL when the interpreter
starts finalizing: torch 2.13 then dies with SIGABRT ("terminate called without an active
exception") in every run, where an unchanged script does so in a few runs of 20
(``tools/exit_race``), unless an exit handler that runs after these (phalanx's exit guard,
registered before the script starts) lets gloo's thread through first.

``abort`` and ``raise``: rank 0 calls ``os.abort()`` or raises after training instead, a real
crash that no guard may hide.
"""

import atexit
import ctypes
import os
import sys
import time

SHARED = sys.argv[1]
MODE = sys.argv[2] if len(sys.argv) > 2 else "finish"
RANK = int(os.environ["RANK"])
GO, DONE = os.path.join(SHARED, "go"), os.path.join(SHARED, "done")
LIBC = ctypes.PyDLL(None)  # PyDLL: a call keeps the GIL
POLLIN = 1


class PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


if RANK == 0 and MODE == "finish":
    # Registered before torch registers its own, so these run last (atexit is LIFO).
    os.mkfifo(DONE)
    done = PollFd(os.open(DONE, os.O_RDWR), POLLIN, 0)  # O_RDWR: this open does not block
    atexit.register(LIBC.usleep, 20_000)  # gloo's thread on rank 0 ends its part meanwhile
    atexit.register(LIBC.poll, ctypes.byref(done), 1, 60_000)  # until rank 1 writes DONE
    atexit.register(lambda: open(GO, "w").close())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
dist.init_process_group("gloo")
model = DistributedDataParallel(torch.nn.Linear(32, 32))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(3):
    optimizer.zero_grad()
    model(torch.randn(8, 32)).sum().backward()
    optimizer.step()
print(f"rank {RANK} trained", flush=True)
if RANK == 0 and MODE == "abort":
    os.abort()
if RANK == 0 and MODE == "raise":
    raise RuntimeError("crash after training")

works = []
last = torch.ones(1, requires_grad=True)
last.register_hook(lambda grad: works.append(dist.all_reduce(torch.ones(1), async_op=True)))
if RANK == 1:
    while not os.path.exists(GO):  # rank 0 is in its last exit handlers, holding the GIL
        time.sleep(0.01)
last.sum().backward()
if RANK == 0:
    works.clear()  # gloo's thread now holds the last reference to the work
else:
    works[0].wait()
    with open(DONE, "wb") as fifo:
        fifo.write(b"x")
