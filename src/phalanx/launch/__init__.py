"""The launcher: ``phalanx run`` (every torchrun option) and ``phalanx.spawn``.

Modules, one idea each: ``options`` (the option table), ``args`` / ``checks`` / ``nproc`` (flags
to a frozen ``config``, pure), ``preflight`` (resolve / reach the master), ``rendezvous`` (the
agents' protocol over node 0's store), ``agent`` (generations, restarts), ``attempt`` (each
worker's command, environment and logs), ``worker_env`` (the environment contract), ``workers``
(processes, stopping), ``output`` / ``prefix`` (live console output with ``[rank N]``), ``logs``
(torchrun's log files), ``events`` (torchrun's event log), ``summary`` (failure report),
``backend_note`` (the workers' backend in the start-up line), ``spawn``; gloo's interface comes
from ``phalanx.comm.netif`` (shared with the workers);
``--recovery live``: ``live`` (replace a dead worker alone), ``live_enforce`` (kill the workers
the job declared dead, and stopped ones), ``live_keys`` (the contract with the workers:
variables, death marker), ``live_nodes`` (lost and returning nodes), ``live_outcome`` (the job's
exit code), ``worker_store`` (the store the workers meet in).
"""

from __future__ import annotations

from phalanx.comm.netif import interface_for
from phalanx.launch.run import main
from phalanx.launch.spawn import SpawnContext, SpawnError, spawn

__all__ = ["SpawnContext", "SpawnError", "interface_for", "main", "spawn"]
