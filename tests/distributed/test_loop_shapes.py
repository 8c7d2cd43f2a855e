"""The loop as users write it: every loop shape x strategy x way of stopping, resumed exactly.

A generated matrix. A *loop shape* is three choices a user makes:

- the loader made once before the loop, or inside the epoch loop;
- ``job.progress(loader)`` or the plain loader;
- ``job.epochs(n)``, a plain ``range(job.resume(), n)``, or that ``range`` with torch's
  ``loader.sampler.set_epoch(epoch)`` in the loop.

Each shape runs with DDP, and a pairwise covering of six shapes with ZeRO-2, ZeRO-3 and a
pipeline of two stages (150 cases in all); each stops once in five ways: after an epoch's save,
after a save in the middle of an epoch, by ``break`` out of an epoch followed by a save (early
stopping), by an exception raised right after an (asynchronous) save inside ``with
phalanx.Job(...)``, or by a save and an exception after a batch was fetched but before it was
trained. A fresh job then resumes from the newest checkpoint and trains to the end.

The uninterrupted run of the first shape is the reference. Its epochs each read every sample
exactly once, in a different order each epoch. Every shape, stopped and resumed any way, trains
the same batches in the same order (none twice, none skipped) and ends with bit-identical
parameters: the model has dropout, so a resume that restores the generators at another moment
differs. A ``break`` ends its epoch (the rest of it is skipped), so a run resumed after one is
compared with a run that breaks at the same batch and goes on. The samples are identified by an
index column of the dataset.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx
from phalanx.testing import run_distributed
from tests.distributed.gpt_cases import BLOCK, VOCAB, lm_loss, params_digest, small_gpt

EPOCHS = 3
PER_RANK_BATCH = 2
BATCHES = 4  # per replica and epoch
STOP_AT = (1, 2)  # mid-epoch stops: in this epoch, after this many of its steps

STRATEGIES: dict[str, Any] = {
    "ddp": "ddp",
    "zero2": "zero2",
    "zero3": "zero3",
    "pp2": phalanx.Mesh(dp=1, pp=2, micro_batches=2),
}
SHAPES = [
    f"{made}/{iterate}/{epochs}"
    for made, iterate, epochs in itertools.product(
        ("once", "in-loop"), ("progress", "plain"), ("epochs", "range", "set_epoch")
    )
]
STOPS = ("epoch-end", "mid-epoch", "break", "exception", "unstepped")
COVERING = [
    "once/progress/epochs",
    "in-loop/progress/range",
    "once/progress/set_epoch",
    "in-loop/plain/epochs",
    "once/plain/range",
    "in-loop/plain/set_epoch",
]
"""Every pair of choices of two kinds at least once (pairwise covering): the shapes of the
strategies other than DDP, which runs all of :data:`SHAPES` (the loop-shape logic is the job's,
the same under every strategy)."""


class Stop(Exception):
    """Raised by the ``exception`` stop."""


def _data(replicas: int) -> torch.utils.data.TensorDataset:
    n = BATCHES * replicas * PER_RANK_BATCH
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (n, BLOCK), generator=g)
    return torch.utils.data.TensorDataset(
        x, torch.randint(0, VOCAB, x.shape, generator=g), torch.arange(n)
    )


def _run(strategy: Any, shape: str, stop: str | None, ckpt: Path) -> dict[str, Any]:
    """Train (resuming from ``ckpt``) until the end or ``stop``; the batches trained and the
    final parameters."""
    made, iterate, epochs = shape.split("/")
    torch.manual_seed(0)
    model = small_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    trained: list[tuple[int, list[int]]] = []
    try:
        with phalanx.Job(strategy, checkpoint_dir=ckpt, straggler_check_every=0) as job:
            mesh = isinstance(strategy, phalanx.Mesh)
            model, opt = job.setup(model, opt, loss_fn=None if mesh else lm_loss)
            replicas = 1 if mesh else job.world.world_size
            data = _data(replicas)

            def loader() -> Any:
                return job.loader(data, batch_size=PER_RANK_BATCH, shuffle=True)

            once = loader() if made == "once" else None
            driven = epochs == "epochs"
            for epoch in job.epochs(EPOCHS) if driven else range(job.resume(), EPOCHS):
                batches = once if once is not None else loader()
                assert len(batches) == BATCHES
                if epochs == "set_epoch":  # torch's idiom, kept by the job
                    batches.sampler.set_epoch(epoch)
                steps = 0  # of this epoch, in this run
                for x, y, idx in job.progress(batches) if iterate == "progress" else batches:
                    if (epoch, steps) == STOP_AT and stop == "unstepped":
                        job.save()  # a batch fetched, not trained: the resume point is before it
                        raise Stop
                    if mesh:
                        job.forward_backward(x, y)
                    else:
                        job.backward(lm_loss(model(x), y))
                    assert job.step(opt)
                    trained.append((job.epoch, idx.tolist()))
                    steps += 1
                    if (epoch, steps) != STOP_AT or stop in (None, "epoch-end", "unstepped"):
                        continue
                    if stop in ("break", "break-and-go-on"):
                        break
                    job.save()
                    if stop == "exception":
                        raise Stop
                    return {"trained": trained, "params": None}
                job.save()
                if stop in ("epoch-end", "break") and epoch == STOP_AT[0] - (stop == "epoch-end"):
                    return {"trained": trained, "params": None}
            return {"trained": trained, "params": params_digest(model)}
    except Stop:
        return {"trained": trained, "params": None}


def _shapes(name: str) -> list[str]:
    return SHAPES if name == "ddp" else COVERING


def _matrix(strategy: Any, shapes: list[str], root: str) -> dict[str, Any]:
    base = Path(root)
    out: dict[str, Any] = {"ref": _run(strategy, SHAPES[0], None, base / "ref")}
    # A break ends the epoch: the run that breaks there and goes on is the break's reference.
    out["ref-break"] = _run(strategy, SHAPES[0], "break-and-go-on", base / "ref-break")
    for shape, stop in itertools.product(shapes, STOPS):
        where = base / shape.replace("/", "-") / stop
        first = _run(strategy, shape, stop, where)
        second = _run(strategy, shape, None, where)
        out[f"{shape}:{stop}"] = {"first": first, "second": second}
    return out


@pytest.fixture(scope="module", params=list(STRATEGIES))
def matrix(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[dict[str, Any]]]:
    name = request.param
    root = str(tmp_path_factory.mktemp(f"loops-{name}"))
    shapes = _shapes(name)
    return name, run_distributed(_matrix, STRATEGIES[name], shapes, root, world_size=2, timeout=300)


def _check_reference(name: str, ranks: list[dict[str, Any]]) -> None:
    """Each epoch reads every sample once (over the replicas), in a new order each epoch."""
    replicas = 1 if name == "pp2" else len(ranks)
    by_epoch: dict[int, list[int]] = {}
    orders: dict[int, list[list[int]]] = {}
    for got in ranks[:replicas]:
        for epoch, idx in got["ref"]["trained"]:
            by_epoch.setdefault(epoch, []).extend(idx)
            orders.setdefault(epoch, []).append(idx)
    n = BATCHES * replicas * PER_RANK_BATCH
    assert sorted(by_epoch) == list(range(EPOCHS))
    for epoch, seen in by_epoch.items():
        assert sorted(seen) == list(range(n)), f"epoch {epoch} reads {sorted(seen)}"
    assert len({str(o) for o in orders.values()}) == EPOCHS, "an epoch repeats another's order"


def test_every_loop_shape_trains_and_resumes_exactly(
    matrix: tuple[str, list[dict[str, Any]]],
) -> None:
    name, ranks = matrix
    _check_reference(name, ranks)
    wrong: list[str] = []
    for rank, got in enumerate(ranks):
        for case in (c for c in got if not c.startswith("ref")):
            ref = got["ref-break" if case.endswith(":break") else "ref"]
            first, second = got[case]["first"], got[case]["second"]
            if first["trained"] + second["trained"] != ref["trained"]:
                wrong.append(
                    f"rank {rank} {case}: batches {first['trained']} + {second['trained']}"
                )
            elif second["params"] != ref["params"]:
                wrong.append(f"rank {rank} {case}: final parameters differ")
    cases = len(ranks) * len(_shapes(name)) * len(STOPS)
    assert not wrong, f"{name}: {len(wrong)} of {cases} fail:\n" + "\n".join(wrong)


def _eval_inside_and_twice(root: str) -> dict[str, Any]:
    """An eval loader read inside the training loop, the training loader read twice in an
    epoch, and a training loader over other data mid-epoch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(BLOCK, 1)
    with phalanx.Job("ddp", checkpoint_dir=Path(root) / "ckpt", straggler_check_every=0) as job:
        model, opt = job.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        data = _data(job.world.world_size)
        loader = job.loader(data, batch_size=PER_RANK_BATCH, shuffle=True)
        held_out = job.loader(_data(1), batch_size=3, eval=True)
        trained, evaluated, again = [], [], []
        for epoch in job.epochs(2):
            for x, _, idx in loader:
                model(x.float()).mean().backward()
                job.step(opt)
                trained.append((epoch, idx.tolist()))
                evaluated.append([i.tolist() for _, _, i in held_out])  # eval inside the loop
            again.append([idx.tolist() for _, _, idx in loader])  # a second pass, same epoch
        refused = []
        try:
            job.loader(_data(2 * job.world.world_size), batch_size=PER_RANK_BATCH)
        except ValueError as exc:
            refused.append(str(exc))
        job.loader(data, batch_size=PER_RANK_BATCH)  # takes the first one's place
        try:
            next(iter(loader))
        except ValueError as exc:
            refused.append(str(exc))
        return {"trained": trained, "evaluated": evaluated, "again": again, "refused": refused}


def test_eval_loaders_inside_the_loop_and_a_second_pass_leave_training_alone(
    tmp_path: Path,
) -> None:
    ranks = run_distributed(_eval_inside_and_twice, str(tmp_path), world_size=2, timeout=120)
    for rank, got in enumerate(ranks):
        by_epoch = [[idx for e, idx in got["trained"] if e == epoch] for epoch in range(2)]
        assert by_epoch[0] != by_epoch[1] and all(len(b) == BATCHES for b in by_epoch)
        # Re-reading the loader inside an epoch repeats that epoch's order (torch's set_epoch).
        assert got["again"] == by_epoch, f"rank {rank}"
        # The eval loader reads its whole (unshuffled) data every time, whatever training does.
        assert all(e == got["evaluated"][0] for e in got["evaluated"]), f"rank {rank}"
        # Other data, and a loader whose place a newer one took, are refused, naming the fix.
        other, stale = got["refused"]
        assert "a job has one training loader" in other and "eval=True" in other
        assert "replaced by a newer job.loader(...)" in stale
