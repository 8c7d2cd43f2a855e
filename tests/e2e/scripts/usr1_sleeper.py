"""Report SIGUSR1 and carry on sleeping; write DIR/ready<rank> once the handler is set."""

import os
import signal
import sys
import time

rank = os.environ["RANK"]


def on_usr1(signum: int, frame: object) -> None:
    print(f"SIGUSR1 in rank {rank}", flush=True)


signal.signal(signal.SIGUSR1, on_usr1)
with open(os.path.join(sys.argv[1], f"ready{rank}"), "w") as f:
    f.write(str(os.getpid()))
for _ in range(600):
    time.sleep(0.1)
