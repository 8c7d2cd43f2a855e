"""SampleLedger: which samples each committed step trained, and proof of "exactly once per epoch".

Each rank records, after a step commits, the dataset indices it trained in it
(:meth:`SampleLedger.record`); the ranks' ledgers merge into one (:meth:`SampleLedger.merge`), for
tests and for ``phalanx diagnose``. :meth:`SampleLedger.audit` then names, per epoch, the samples
never trained (*missing*), trained more than once (*repeated*, with the steps and ranks), and
trained although ``drop_last`` left them out (*unexpected*).

Compact: ids are stored as runs ``[start, length]`` of *positions in the epoch's order* (the
order is a function of seed, epoch, dataset size and shuffle, see
:func:`~phalanx.data.elastic_plan.epoch_order`). Under :class:`~phalanx.data.ElasticSampler` a
rank's ids in a step are one run whatever the shuffle, so a step costs ``2 + 3 W`` integers
(step, epoch, and rank, start, length per rank), independent of the batch size: per 1M samples,
``(1M / G) * (2 + 3 W)`` integers. Measured, one epoch of 1M shuffled samples in compact JSON:
259 KB at G = 256, W = 4 (3907 steps); 233 KB at G = 1024, W = 16; 3.6 MB at G = 32, W = 8
(31250 steps). Ids that do not follow the order (a bug the audit should name) cost up to two
integers each; nothing is lost. In memory the ledger also caches one epoch's order and its inverse
(16 bytes a sample) while recording or auditing that epoch.

The JSON form (:meth:`SampleLedger.to_dict`)::

    {"format": "phalanx.sample_ledger/1", "dataset_len": N, "seed": s, "shuffle": true,
     "used_per_epoch": U,
     "steps": [[step, epoch, [[rank, start, length, start, length, ...], ...]], ...]}
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx._check import FLAG, check_int, checked, part_of, rule
from phalanx.data.elastic_plan import epoch_order, used_per_epoch
from phalanx.data.elastic_sampler import ElasticSampler

__all__ = ["EpochAudit", "SampleLedger"]

FORMAT = "phalanx.sample_ledger/1"
_SHOWN = 20
"""Ids named in a message before "... and k more"."""


@dataclass(frozen=True)
class EpochAudit:
    """One epoch of a ledger, checked against its order."""

    epoch: int
    trained: int
    """Samples recorded in the epoch (repeats counted)."""
    missing: tuple[int, ...]
    """Ids the epoch's steps should have trained and did not (sorted)."""
    repeated: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    """Id -> the (step, rank) of each time it was trained, for ids trained more than once."""
    unexpected: tuple[int, ...] = ()
    """Ids trained although ``drop_last`` leaves them out of this epoch."""

    @property
    def ok(self) -> bool:
        """Every sample of the epoch exactly once."""
        return not (self.missing or self.repeated or self.unexpected)

    def problems(self) -> list[str]:
        """One line per kind of problem, naming the samples; empty when :attr:`ok`."""
        lines = []
        if self.missing:
            lines.append(f"epoch {self.epoch}: {_named(self.missing)} never trained (missing)")
        if self.repeated:
            where = [f"{i} at (step, rank) {list(at)}" for i, at in sorted(self.repeated.items())]
            lines.append(f"epoch {self.epoch}: {_named(where)} trained more than once")
        if self.unexpected:
            lines.append(f"epoch {self.epoch}: {_named(self.unexpected)} trained but dropped")
        return lines


def _named(items: Iterable[object]) -> str:
    items = list(items)
    head = ", ".join(str(i) for i in items[:_SHOWN])
    more = f" ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return f"{len(items)} sample(s) [{head}{more}]"


def _runs(ids: list[int], order: torch.Tensor, inverse: torch.Tensor) -> list[int]:
    """``ids`` as flat ``[start, length, ...]`` runs of consecutive positions in ``order``."""
    if not ids:
        return []
    first = int(inverse[ids[0]])
    if order[first : first + len(ids)].tolist() == ids:
        return [first, len(ids)]  # a slice of the order, as ElasticSampler hands out: one run
    positions = inverse[torch.tensor(ids)].tolist()
    runs, start, prev = [], positions[0], positions[0]
    for p in positions[1:]:
        if p != prev + 1:
            runs += [start, prev - start + 1]
            start = p
        prev = p
    return [*runs, start, prev - start + 1]


def _check_runs(runs: list[Any], dataset_len: int, what: str) -> None:
    """Raise ValueError unless ``runs`` are ``[start, length]`` pairs of ints inside the order."""
    pairs = list(zip(runs[::2], runs[1::2], strict=False))
    if len(runs) % 2 or not all(isinstance(v, int) and v >= 0 for v in runs):
        raise ValueError(f"{what}: runs {runs} are not pairs of ints >= 0")
    if any(start + length > dataset_len for start, length in pairs):
        raise ValueError(f"{what}: runs {runs} reach past dataset_len={dataset_len}")


def _expand(runs: list[int]) -> torch.Tensor:
    """The positions of flat ``[start, length, ...]`` runs, in order (vectorised)."""
    pairs = torch.tensor(runs, dtype=torch.long).view(-1, 2)
    starts, lengths = pairs[:, 0], pairs[:, 1]
    offsets = torch.cumsum(lengths, 0) - lengths  # where each run begins in the output
    within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(offsets, lengths)
    return torch.repeat_interleave(starts, lengths) + within


class SampleLedger:
    """Sample ids of each committed step, per epoch and rank; JSON-able; audited per epoch.

    Args:
        dataset_len: Samples in the dataset.
        seed: The sampler's base seed (fixes each epoch's order).
        shuffle: Whether the sampler shuffles.
        used_per_epoch: Samples each epoch trains: ``dataset_len``, or with ``drop_last`` the
            full global batches (default ``dataset_len``). :meth:`for_sampler` fills it in.

    Raises:
        ValueError / TypeError: an argument out of range or of the wrong type, named.
    """

    @checked(
        dataset_len=rule(check_int, min=0),
        seed=rule(check_int),
        shuffle=FLAG,
        used_per_epoch=rule(check_int, min=0),
    )
    def __init__(
        self, dataset_len: int, *, seed: int, shuffle: bool, used_per_epoch: int | None = None
    ) -> None:
        used = dataset_len if used_per_epoch is None else used_per_epoch
        if used > dataset_len:
            raise ValueError(
                f"SampleLedger: used_per_epoch={used} exceeds dataset_len={dataset_len}"
            )
        self.dataset_len, self.seed, self.shuffle, self.used_per_epoch = (
            dataset_len,
            seed,
            shuffle,
            used,
        )
        self._steps: dict[tuple[int, int], list[tuple[int, list[int]]]] = defaultdict(list)
        self._order: tuple[int, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def for_sampler(cls, sampler: ElasticSampler) -> SampleLedger:
        """An empty ledger for the order and epoch length of ``sampler``."""
        n, g = len(sampler.dataset), sampler.global_batch_size
        used = used_per_epoch(n, g, sampler.drop_last)
        return cls(n, seed=sampler.seed, shuffle=sampler.shuffle, used_per_epoch=used)

    def _orders(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The epoch's order and its inverse (id -> position); the last epoch's is cached."""
        if self._order is None or self._order[0] != epoch:
            order = epoch_order(self.dataset_len, self.seed, epoch, self.shuffle)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(self.dataset_len)
            self._order = (epoch, order, inverse)
        return self._order[1], self._order[2]

    # ---- recording -------------------------------------------------------------------------
    def record(self, step: int, epoch: int, rank: int, ids: Iterable[int]) -> None:
        """``rank`` trained the samples ``ids`` (dataset indices) in committed step ``step`` of
        ``epoch``. Record only committed steps; a redone step is recorded once, when it commits.

        Raises:
            ValueError: an id outside ``[0, dataset_len)``, or a negative step, epoch or rank.
        """
        where = "SampleLedger.record"
        step = check_int("step", step, min=0, where=where)
        epoch = check_int("epoch", epoch, min=0, where=where)
        rank = check_int("rank", rank, min=0, where=where)
        got = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if not all(type(i) is int for i in got):  # numpy integers and such: as ints, checked
            with part_of("ids", got, where):
                got = [check_int(f"ids[{k}]", i) for k, i in enumerate(got)]
        if got and (min(got) < 0 or max(got) >= self.dataset_len):
            bad = [i for i in got if not 0 <= i < self.dataset_len]
            raise ValueError(
                f"{where}: ids {_named(bad)} of step={step}, rank={rank} are outside "
                f"[0, dataset_len) with dataset_len={self.dataset_len}"
            )
        self._steps[(step, epoch)].append((rank, _runs(got, *self._orders(epoch))))

    def merge(self, other: SampleLedger) -> None:
        """Add ``other``'s records (another rank's ledger of the same run) to this one."""
        if other._config() != self._config():
            raise ValueError(
                f"SampleLedger.merge: other={other._config()} records another order than this "
                f"ledger's {self._config()}"
            )
        for key, entries in other._steps.items():
            self._steps[key].extend((rank, list(runs)) for rank, runs in entries)

    def forget_from(self, epoch: int, step: int) -> None:
        """Drop the records of step ``step`` of ``epoch`` and of every later step: live
        recovery rolled the job back to before them (they will be trained and recorded again).

        Raises:
            ValueError: a negative ``epoch`` or ``step``.
        """
        where = "SampleLedger.forget_from"
        at = (
            check_int("epoch", epoch, min=0, where=where),
            check_int("step", step, min=0, where=where),
        )
        for s, e in [k for k in self._steps if (k[1], k[0]) >= at]:
            del self._steps[(s, e)]

    def _config(self) -> dict[str, Any]:
        return {
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "used_per_epoch": self.used_per_epoch,
        }

    # ---- reading ---------------------------------------------------------------------------
    @property
    def epochs(self) -> list[int]:
        """Epochs with records, ascending."""
        return sorted({epoch for _, epoch in self._steps})

    def entries(self, epoch: int | None = None) -> Iterator[tuple[int, int, int, list[int]]]:
        """``(step, epoch, rank, ids)`` of each record, in step then rank order."""
        for step, ep in sorted(self._steps):
            if epoch is not None and ep != epoch:
                continue
            order = self._orders(ep)[0]
            for rank, runs in sorted(self._steps[(step, ep)], key=lambda e: e[0]):
                yield step, ep, rank, order[_expand(runs)].tolist()

    def audit(self, epoch: int) -> EpochAudit:
        """Check ``epoch``: each of its samples trained exactly once, the dropped ones never."""
        epoch = check_int("epoch", epoch, min=0, where="SampleLedger.audit")
        order = self._orders(epoch)[0]
        runs = [r for (_, ep), recs in self._steps.items() if ep == epoch for _, r in recs]
        trained = order[_expand([v for r in runs for v in r])]
        counts = torch.bincount(trained, minlength=self.dataset_len)
        expected, dropped = order[: self.used_per_epoch], order[self.used_per_epoch :]
        repeated = set(torch.nonzero(counts > 1).flatten().tolist())
        return EpochAudit(
            epoch=epoch,
            trained=trained.numel(),
            missing=tuple(sorted(expected[counts[expected] == 0].tolist())),
            repeated=self._where(epoch, repeated) if repeated else {},
            unexpected=tuple(sorted(dropped[counts[dropped] > 0].tolist())),
        )

    def _where(self, epoch: int, ids: set[int]) -> dict[int, tuple[tuple[int, int], ...]]:
        """The (step, rank) of each time one of ``ids`` was trained in ``epoch``."""
        at: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for step, _, rank, trained in self.entries(epoch):
            for i in trained:
                if i in ids:
                    at[i].append((step, rank))
        return {i: tuple(places) for i, places in sorted(at.items())}

    def problems(self, epochs: Iterable[int] | None = None) -> list[str]:
        """Every problem of ``epochs`` (default: every recorded epoch), one line each; an empty
        list proves every sample exactly once in each of them."""
        chosen = self.epochs if epochs is None else list(epochs)
        return [line for epoch in chosen for line in self.audit(epoch).problems()]

    # ---- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form (see the module docstring)."""
        steps = []
        for step, epoch in sorted(self._steps):
            ranks = sorted(self._steps[(step, epoch)], key=lambda e: e[0])
            steps.append([step, epoch, [[rank, *runs] for rank, runs in ranks]])
        return {"format": FORMAT, **self._config(), "steps": steps}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SampleLedger:
        """A ledger from :meth:`to_dict`'s form (read back from JSON).

        Raises:
            ValueError: ``data`` is not a sample ledger of this format.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"SampleLedger.from_dict: data is not a {FORMAT!r} ledger")
        try:
            ledger = cls(
                data["dataset_len"],
                seed=data["seed"],
                shuffle=data["shuffle"],
                used_per_epoch=data["used_per_epoch"],
            )
            for step, epoch, ranks in data["steps"]:
                for rank, *runs in ranks:
                    _check_runs(runs, ledger.dataset_len, f"step {step} rank {rank}")
                    ledger._steps[(int(step), int(epoch))].append((int(rank), list(runs)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"SampleLedger.from_dict: malformed ledger ({exc})") from None
        return ledger
