"""Process sets: Horovod's subsets of ranks, each a torch process group plus a negotiation group.

``hvd.add_process_set([0, 2])`` (called on every rank, in the same order, as Horovod requires)
creates the set's data group (the job's backend) and, for sets of two or more, a gloo group for
the negotiation rows, and returns a :class:`ProcessSet` whose ``process_set_id`` is the same on
every rank. ``process_set=`` of every operation takes one (default: the global set); a
``torch.distributed`` process group on gloo is accepted too, its rows then travel on the group
itself. ``shutdown()`` forgets every set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

from phalanx._check import check_int, check_ints
from phalanx.comm.shm import GLOO_P2P
from phalanx.horovod.controller import Controller

__all__ = [
    "ProcessSet",
    "add_process_set",
    "controller",
    "global_process_set",
    "remove_process_set",
    "reset",
    "resolve",
    "setup",
]


class ProcessSet:
    """A set of ranks that runs collectives together (Horovod's ``hvd.ProcessSet``).

    Args:
        ranks: Global ranks of the set (sorted; each once).
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks: list[int] = sorted(check_ints("ranks", ranks, min=0, where="ProcessSet"))
        self.process_set_id: int | None = None
        """The same on every rank once added; None before ``add_process_set`` / after removal."""
        self.group: Any = None
        """The data group (None: the default group)."""
        self._controller: Controller | None = None

    def size(self) -> int | None:
        """Number of ranks in the set (None if it is not initialized)."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (None if not initialized or not a member)."""
        if self.process_set_id is None or dist.get_rank() not in self.ranks:
            return None
        return self.ranks.index(dist.get_rank())

    def included(self) -> bool | None:
        """Whether this process belongs to the set (None if it is not initialized)."""
        return None if self.process_set_id is None else dist.get_rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
"""Every rank of the job (``process_set_id`` 0)."""
_SETS: dict[int, ProcessSet] = {}
_RAW: dict[int, ProcessSet] = {}  # id(torch group) -> its wrapper
_BUILT_FOR: list[Any] = [None]  # the default group the global set was built for


def _label(ps: ProcessSet) -> str:
    if ps is global_process_set:
        return "the global process set"
    return f"process set {ps.process_set_id} (ranks {ps.ranks})"


def _require_init() -> None:
    if not dist.is_initialized():
        raise ValueError("Horovod has not been initialized; call hvd.init() first")


def _ensure_global() -> None:
    """(Re)build the global set for the current default group: a collective on first use."""
    default = distributed_c10d._get_default_group()
    if _BUILT_FOR[0] is default:
        return
    reset()
    n = dist.get_world_size()
    meta = dist.new_group(backend="gloo") if n > 1 else None
    global_process_set.ranks = list(range(n))
    global_process_set.process_set_id = 0
    global_process_set._controller = Controller(
        global_process_set.ranks, meta, _label(global_process_set)
    )
    _SETS[0] = global_process_set
    _BUILT_FOR[0] = default


def setup() -> None:
    """Build the global set now (``init()``): every rank creates its negotiation group."""
    _require_init()
    _ensure_global()


def reset() -> None:
    """Forget every process set (``shutdown()``) and destroy the groups made for them."""
    alive = dist.is_initialized() and _BUILT_FOR[0] is distributed_c10d._get_default_group()
    for ps in _SETS.values():
        if ps._controller is not None:
            ps._controller.discard()
            if alive:  # else they died with the default group they belonged to
                _destroy(ps._controller.meta, None if ps is global_process_set else ps.group)
        ps._controller = None
        if ps is not global_process_set:
            ps.process_set_id, ps.group = None, None
    for ps in _RAW.values():  # wrappers of the caller's torch groups: the groups are theirs
        if ps._controller is not None:
            ps._controller.discard()
        ps._controller = None
    _SETS.clear()
    _RAW.clear()
    _BUILT_FOR[0] = None


def _destroy(*groups: Any) -> None:
    for group in groups:
        if group is not None:
            dist.destroy_process_group(group)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Create a process set on every rank (collective: every rank calls it, in the same order).

    Args:
        process_set: A :class:`ProcessSet` or a list of global ranks.

    Returns:
        The set, initialized (``process_set_id`` assigned).
    """
    _require_init()
    _ensure_global()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    n = dist.get_world_size()
    if (
        not ps.ranks
        or len(set(ps.ranks)) != len(ps.ranks)
        or not 0 <= ps.ranks[0] <= ps.ranks[-1] < n
    ):
        raise ValueError(f"add_process_set: ranks {ps.ranks} must be distinct ranks in 0..{n - 1}")
    if any(other.ranks == ps.ranks for other in _SETS.values()):
        raise ValueError(
            f"Attempted to add a duplicate process set: ranks {ps.ranks} exist already"
        )
    ps.group = dist.new_group(ps.ranks)
    meta = dist.new_group(ps.ranks, backend="gloo") if len(ps.ranks) > 1 else None
    ps.process_set_id = max(_SETS) + 1
    _SETS[ps.process_set_id] = ps
    if dist.get_rank() in ps.ranks:
        ps._controller = Controller(ps.ranks, meta, _label(ps))
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a set added by :func:`add_process_set` (every rank calls it); True on success."""
    ps = process_set
    if not isinstance(ps, ProcessSet) or ps is global_process_set or ps.process_set_id is None:
        return False
    if _SETS.get(ps.process_set_id) is not ps:
        return False
    del _SETS[ps.process_set_id]
    if ps._controller is not None:  # a member: the groups are real here
        ps._controller.discard()
        _destroy(ps.group, ps._controller.meta)
    ps.process_set_id, ps.group, ps._controller = None, None, None
    return True


def resolve(process_set: Any, root_rank: int | None = None, member: bool = True) -> ProcessSet:
    """The :class:`ProcessSet` an operation runs on; checks ``root_rank`` and, when ``member``,
    that this rank belongs to it."""
    _require_init()
    _ensure_global()
    if process_set is None:
        ps = global_process_set
    elif isinstance(process_set, ProcessSet):
        ps = process_set
        if ps.process_set_id is None or _SETS.get(ps.process_set_id) is not ps:
            raise ValueError(
                f"{ps} is not an added process set; create it with "
                f"hvd.add_process_set(ranks) on every rank first"
            )
    elif isinstance(process_set, dist.ProcessGroup):
        ps = _wrap(process_set)
    else:
        raise TypeError(
            f"process_set must be an hvd.ProcessSet (or a torch.distributed "
            f"ProcessGroup), got {type(process_set).__name__}"
        )
    if member and dist.get_rank() not in ps.ranks:
        raise ValueError(
            f"[rank {dist.get_rank()}] this rank is not in {_label(ps)}; only its "
            f"members may call operations on it"
        )
    if root_rank is not None:
        check_int("root_rank", root_rank, min=0, where="hvd")
    if root_rank is not None and root_rank not in ps.ranks:
        raise ValueError(
            f"root_rank={root_rank} is not a rank of the process set (ranks {ps.ranks})"
        )
    return ps


def _wrap(group: dist.ProcessGroup) -> ProcessSet:
    """A torch group used as a process set: its rows travel on the group itself (gloo only)."""
    if id(group) not in _RAW:
        if dist.get_backend(group) not in GLOO_P2P:
            raise ValueError(
                "process_set: a torch.distributed group on a non-gloo backend cannot "
                "carry Horovod's negotiation; create the set with "
                "hvd.add_process_set(ranks) instead"
            )
        ps = ProcessSet(dist.get_process_group_ranks(group))
        ps.process_set_id, ps.group = -1, group
        ps._controller = Controller(ps.ranks, group, f"the process group of ranks {ps.ranks}")
        _RAW[id(group)] = ps
    return _RAW[id(group)]


def controller(ps: ProcessSet) -> Controller:
    """The controller of a resolved set (this rank is a member)."""
    assert ps._controller is not None, f"no controller for {ps} on this rank"
    return ps._controller
