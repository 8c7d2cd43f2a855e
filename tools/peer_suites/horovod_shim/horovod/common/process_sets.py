"""``horovod.common.process_sets``: process sets, as ``phalanx.horovod`` implements them."""

from __future__ import annotations

from phalanx.horovod import ProcessSet, add_process_set, global_process_set, remove_process_set

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
