"""Stand-in for the ``mock`` backport that Horovod's test helpers import: the standard library's."""

from unittest.mock import *  # noqa: F403
