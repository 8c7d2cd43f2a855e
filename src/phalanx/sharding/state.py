"""Old path of :mod:`phalanx.sharding.pieces`, kept only for ``train/job_checkpoint.py``."""

from phalanx.sharding.pieces import Piece, PieceReader, Sharded, ShardedState  # noqa: F401
