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

from typing import TYPE_CHECKING

from phalanx import _lazy

if TYPE_CHECKING:  # loaded by __getattr__ on first use (the launcher needs .keys without torch)
    from phalanx.recovery.errors import Excluded, JobFinished, PeerLost, RecoveryError
    from phalanx.recovery.keys import live_signer, report_death
    from phalanx.recovery.live_group import LiveGroup
    from phalanx.recovery.membership import Member
    from phalanx.recovery.peer_shards import RestoredShards, ShardsLost, restore_shards
    from phalanx.recovery.shard_mirror import ShardMirror
    from phalanx.recovery.startup import live_mode
    from phalanx.recovery.transfer import rng_state, set_rng_state, share_state

_MODULES = {
    "errors": "Excluded JobFinished PeerLost RecoveryError",
    "keys": "live_signer report_death",
    "live_group": "LiveGroup",
    "membership": "Member",
    "peer_shards": "RestoredShards ShardsLost restore_shards",
    "shard_mirror": "ShardMirror",
    "startup": "live_mode",
    "transfer": "rng_state set_rng_state share_state",
}
__getattr__, __dir__ = _lazy.exports(__name__, _lazy.from_modules(__name__, _MODULES))

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
