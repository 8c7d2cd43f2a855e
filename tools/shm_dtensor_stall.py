"""FSDP2 on a backend="shm" group, then DTensor's ``full_tensor()``, in a loop: the check for a
deadlock fixed in ``comm/shm/base.py`` (see docs/shm.md, "DTensor's functional collectives").

Before the fix, torch's functional collectives went to the group's gloo backend with the GIL
held, and beside CPU burners a run stalled until gloo's send timeout (20 s). Not in
``make test``. Run beside burners, e.g.
``for i in 1 2 3 4; do python -c 'while 1: pass' & done; python tools/shm_dtensor_stall.py 10``
(``... 10 gloo`` runs the same loop on gloo).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.distributed.test_shm_backend import _fsdp2_sums

from phalanx.testing import run_distributed

BACKEND = sys.argv[2] if len(sys.argv) > 2 else "shm"

if __name__ == "__main__":
    for k in range(int(sys.argv[1])):
        run_distributed(_fsdp2_sums, 200, world_size=2, backend=BACKEND, timeout=60)
        print(k, "ok", flush=True)
