"""``phalanx verify``: run a training script twice and name the first step and value that diverge.

- :mod:`.probe`: what each rank of a verified run records (a ``phalanx.Job`` observer);
- :mod:`.compare`: the noise bound and the first divergence, from two runs' records;
- :mod:`.cli`: the command, its three modes (resume, strategy, world) and its report;
- :mod:`.plot`: the picture of each step's difference against its bound.

The verifier works on a whole job, so unlike the rest of :mod:`phalanx.diagnostics` it reads
``phalanx.train`` (the job it observes) and ``phalanx.checkpoint`` (each step's snapshot is a
checkpoint, which every strategy knows how to write and which reads back whole at any world
size).
"""
