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
``(1M / G) * (2 + 3 W)`` integers (G = 256, W = 4: 3907 steps, 54.7k integers; the JSON size is
measured in the tests). Ids that do not follow the order (a bug the audit should name) cost two
integers each; nothing is lost.

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

from phalanx._check import FLAG, check_int, checked, rule
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


def _runs(positions: torch.Tensor) -> list[int]:
    """``positions`` as flat ``[start, length, ...]`` runs of consecutive values."""
    if positions.numel() == 0:
        return []
    breaks = torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.long), breaks])
    lengths = torch.diff(torch.cat([starts, torch.tensor([positions.numel()])]))
    return torch.stack([positions[starts], lengths], dim=1).flatten().tolist()


def _expand(runs: list[int]) -> Iterator[int]:
    for start, length in zip(runs[::2], runs[1::2], strict=True):
        yield from range(start, start + length)


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
        got = torch.as_tensor(list(ids), dtype=torch.long)
        bad = got[(got < 0) | (got >= self.dataset_len)]
        if bad.numel():
            raise ValueError(
                f"{where}: ids {_named(bad.tolist())} of step={step}, rank={rank} are outside "
                f"[0, dataset_len) with dataset_len={self.dataset_len}"
            )
        self._steps[(step, epoch)].append((rank, _runs(self._orders(epoch)[1][got])))

    def merge(self, other: SampleLedger) -> None:
        """Add ``other``'s records (another rank's ledger of the same run) to this one."""
        if other._config() != self._config():
            raise ValueError(
                f"SampleLedger.merge: other={other._config()} records another order than this "
                f"ledger's {self._config()}"
            )
        for key, entries in other._steps.items():
            self._steps[key].extend((rank, list(runs)) for rank, runs in entries)

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
                yield step, ep, rank, order[list(_expand(runs))].tolist()

    def audit(self, epoch: int) -> EpochAudit:
        """Check ``epoch``: each of its samples trained exactly once, the dropped ones never."""
        epoch = check_int("epoch", epoch, min=0, where="SampleLedger.audit")
        seen: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for step, _, rank, ids in self.entries(epoch):
            for i in ids:
                seen[i].append((step, rank))
        order = self._orders(epoch)[0].tolist()
        expected, dropped = order[: self.used_per_epoch], order[self.used_per_epoch :]
        return EpochAudit(
            epoch=epoch,
            trained=sum(len(at) for at in seen.values()),
            missing=tuple(sorted(i for i in expected if i not in seen)),
            repeated={i: tuple(at) for i, at in seen.items() if len(at) > 1},
            unexpected=tuple(sorted(i for i in dropped if i in seen)),
        )

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
                    if len(runs) % 2 or not all(isinstance(v, int) for v in runs):
                        raise ValueError(f"step {step} rank {rank}: runs {runs} are not pairs")
                    ledger._steps[(int(step), int(epoch))].append((int(rank), list(runs)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"SampleLedger.from_dict: malformed ledger ({exc})") from None
        return ledger
