"""A stand-in ``horovod`` package that runs Horovod's own tests against ``phalanx.horovod``.

Only for ``tools/peer_suites/horovod_suite.py``: ``horovod.torch`` *is* ``phalanx.horovod``;
``horovod.common`` and ``horovod.runner.util.threads`` hold the few names Horovod's test helpers
import. Nothing here is installed with phalanx.
"""
