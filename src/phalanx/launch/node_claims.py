"""Who is which node: the agents' claims of node ranks in the agent store.

Each claim is a signed :class:`~phalanx.launch.agent_values.Claim` (a token, the host name and
the agent's pid); the first valid one at a key wins. Three cases use them:

- **Twins.** Two live agents given the same ``--node-rank`` would hang the job: the second
  fails at once, naming the first (:mod:`.rendezvous`).
- **A relaunch.** When the claim's host is this host and its pid is gone, the claim is this
  node's previous agent: a rebooted or re-run node. In restart mode it joins the job's next
  generation instead of failing as a twin (:class:`PreviousLife`).
- **No ``--node-rank``** (torchrun's c10d form, every node running the same command): the agent
  that hosts the store is node 0, and each other agent takes the lowest rank in
  ``1..nnodes-1`` that no live agent holds; a rank held by a dead agent of this host is taken
  back, so a relaunched host gets its old rank (:func:`take_node_rank`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict

from phalanx.comm.signed import SignedStore
from phalanx.launch import agent_values as values

__all__ = ["NoNodeRank", "PreviousLife", "is_previous_life", "my_claim", "take_node_rank"]

POLL_S = 0.05
AUTO_KEY = "phalanx/node-rank/{}"


class NoNodeRank(RuntimeError):
    """Every node rank an agent without ``--node-rank`` could take is held by a live agent."""


class PreviousLife(Exception):
    """This node's rank in a generation is held by this host's previous (dead) agent."""

    def __init__(self, generation: int, claim: values.Claim) -> None:
        super().__init__(generation, claim)
        self.generation = generation
        self.claim = claim


def my_claim(token: str) -> values.Claim:
    """This agent's claim: its token, host name and pid."""
    return values.Claim(token, socket.gethostname(), os.getpid())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def is_previous_life(claim: values.Claim, token: str) -> bool:
    """Whether ``claim`` (not ours) was made by an agent of this host that has since died."""
    mine = my_claim(token)
    return claim.token != token and claim.host == mine.host and not _alive(claim.pid)


def take_node_rank(
    signed: SignedStore,
    nnodes: int,
    token: str,
    timeout: float,
    check_stop: Callable[[], None],
    where: str,
) -> int:
    """The node rank of an agent started without ``--node-rank`` that does not host the store.

    Raises:
        NoNodeRank: every rank ``1..nnodes-1`` stayed held by a live agent for ``timeout``
            seconds (more agents than ``--nnodes``), naming who holds them.
    """
    claim = asdict(my_claim(token))
    deadline = time.monotonic() + timeout
    while True:
        holders: list[str] = []
        for n in range(1, nnodes):
            key = AUTO_KEY.format(n)
            first = signed.first(key, claim, values.claim)
            if first.token == token:
                return n
            old = signed.raw(key)
            if is_previous_life(first, token) and old and signed.supersede(key, old, claim):
                return n
            holders.append(f"node {n}: {first.host} pid {first.pid}")
        check_stop()
        if time.monotonic() > deadline:
            raise NoNodeRank(
                f"no node rank is free at the rendezvous store {where}: --nnodes {nnodes} "
                f"allows {nnodes - 1} node(s) besides node 0 (which hosts the store), and live "
                f"agents hold them all ({'; '.join(holders)}) for --rdzv-timeout {timeout:.0f} "
                f"s; raise --nnodes or stop the extra agent"
            )
        time.sleep(POLL_S)
