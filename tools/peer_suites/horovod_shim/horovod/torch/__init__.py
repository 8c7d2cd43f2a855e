"""``import horovod.torch as hvd`` gives ``phalanx.horovod`` itself (the same module object)."""

from __future__ import annotations

import sys

import phalanx.horovod

sys.modules[__name__] = phalanx.horovod
