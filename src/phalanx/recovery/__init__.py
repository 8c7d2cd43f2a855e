"""Live recovery: survivors of a lost rank rebuild their group in-process; replacements join.

* :class:`LiveGroup` (:mod:`.live_group`): the default process group across generations;
  ``recover()`` after a failed collective, ``admit()`` at step boundaries.
* :func:`share_state` (:mod:`.transfer`): the training state, bit-exact, from a live member to
  the newcomers of a generation, over the network.
* :class:`ShardMirror` (:mod:`.shard_mirror`) and :func:`restore_shards` (:mod:`.peer_shards`):
  ZeRO shards mirrored on a neighbour in memory, so a single lost rank's shards are restored by
  the survivors at the new world size without a checkpoint.
* :mod:`.keys`: the store protocol, and :func:`report_death` for the launcher.
"""

from __future__ import annotations

from phalanx.recovery.errors import Excluded, JobFinished, PeerLost, RecoveryError
from phalanx.recovery.keys import live_signer, report_death
from phalanx.recovery.live_group import LiveGroup
from phalanx.recovery.membership import Member
from phalanx.recovery.peer_shards import RestoredShards, ShardsLost, restore_shards
from phalanx.recovery.shard_mirror import ShardMirror
from phalanx.recovery.startup import live_mode
from phalanx.recovery.transfer import rng_state, set_rng_state, share_state

__all__ = [
    "Excluded",
    "JobFinished",
    "LiveGroup",
    "Member",
    "PeerLost",
    "RecoveryError",
    "RestoredShards",
    "ShardMirror",
    "ShardsLost",
    "live_mode",
    "live_signer",
    "report_death",
    "restore_shards",
    "rng_state",
    "set_rng_state",
    "share_state",
]
