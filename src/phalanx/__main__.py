"""``python -m phalanx`` is the ``phalanx`` command."""

from __future__ import annotations

import sys

from phalanx.cli import main

sys.exit(main())
