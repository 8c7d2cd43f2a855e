"""phalanx.comm: the wire: process groups, the seeds' communication primitives, explicit
algorithms and the backends.

It carries bytes and counts them (``comm_stats``). What records, checks and explains the
operations (flight records, the mismatch check, hang reports, blame, ``phalanx diagnose``) is
``phalanx.diagnostics``, which installs itself on the wire's one hook, ``watch.py``: nothing here
imports the diagnostics, the data, the checkpoints, the training loop or the launcher
(``tests/unit/test_layers.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx import _lazy

if TYPE_CHECKING:  # loaded by __getattr__ on first use; imported here for type checkers only
    from phalanx.comm.collectives import (
        all_gather,
        all_gather_into_tensor,
        all_reduce,
        all_to_all,
        all_to_all_single,
        barrier,
        broadcast,
        gather,
        reduce,
        reduce_scatter,
        reduce_scatter_tensor,
        scatter,
    )
    from phalanx.comm.env import LaunchEnv, discover_env
    from phalanx.comm.errors import (
        CollectiveError,
        CollectiveMismatchError,
        CollectiveTimeoutError,
    )
    from phalanx.comm.group import (
        World,
        destroy_process_group,
        init_process_group,
        is_initialized,
        is_main,
        main_first,
        process_group,
        world,
    )
    from phalanx.comm.objects import (
        all_gather_object,
        broadcast_object_list,
        gather_object,
        scatter_object_list,
    )
    from phalanx.comm.p2p import batch_isend_irecv, irecv, isend, recv, send
    from phalanx.comm.watch import comm_stats, reset_comm_stats

_MODULES = {
    "collectives": (
        "all_gather all_gather_into_tensor all_reduce all_to_all all_to_all_single barrier "
        "broadcast gather reduce reduce_scatter reduce_scatter_tensor scatter"
    ),
    "env": "LaunchEnv discover_env",
    "errors": "CollectiveError CollectiveMismatchError CollectiveTimeoutError",
    "group": (
        "World destroy_process_group init_process_group is_initialized is_main main_first "
        "process_group world"
    ),
    "objects": "all_gather_object broadcast_object_list gather_object scatter_object_list",
    "p2p": "batch_isend_irecv irecv isend recv send",
    "watch": "comm_stats reset_comm_stats",
}
__getattr__, __dir__ = _lazy.exports(__name__, _lazy.from_modules(__name__, _MODULES))

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "LaunchEnv",
    "World",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "comm_stats",
    "destroy_process_group",
    "discover_env",
    "gather",
    "gather_object",
    "init_process_group",
    "irecv",
    "is_initialized",
    "is_main",
    "isend",
    "main_first",
    "process_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reset_comm_stats",
    "scatter",
    "scatter_object_list",
    "send",
    "world",
]
