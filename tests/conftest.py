"""Settings for every test process, made before any test module imports torch.

``OMP_WAIT_POLICY=PASSIVE`` (unless set already): torch's OpenMP threads (libgomp) sleep as soon
as a parallel region ends instead of spinning for it first. It changes no result and no
variable phalanx reads; it stops idle threads of the pytest workers, and of the processes they
start by hand (every child inherits it), from burning CPU that the other processes of a loaded
machine need. On the 2-core CI box, seed 004's ``mnist.py`` started by hand on 3 ranks
(``tests/e2e/test_examples.py``) took 41 CPU-seconds with libgomp's default and 24 with this.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
