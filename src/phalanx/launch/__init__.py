"""The launcher: ``phalanx run`` (torchrun-compatible flags) and ``phalanx.spawn``.

Modules, one idea each: ``args`` (flags, pure), ``preflight`` (resolve / reach the master),
``rendezvous`` (the agents' protocol over node 0's store), ``agent`` (generations, restarts),
``workers`` (processes, ``[rank N]`` prefixes, stopping), ``worker_env`` (the environment
contract), ``summary`` (failure report), ``netif`` (interface routing to the master), ``spawn``.
"""

from __future__ import annotations

from phalanx.launch.netif import interface_for
from phalanx.launch.run import main
from phalanx.launch.spawn import SpawnContext, SpawnError, spawn

__all__ = ["SpawnContext", "SpawnError", "interface_for", "main", "spawn"]
