"""Horovod's framework-independent names that its tests import, from ``phalanx.horovod``."""
