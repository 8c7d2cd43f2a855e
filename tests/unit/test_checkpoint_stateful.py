"""``save`` / ``load`` take any stateful object, and plain values, in ``objects`` (stateful.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx import checkpoint


class Counter:
    """Neither a Module nor an Optimizer: just torch's Stateful protocol."""

    def __init__(self) -> None:
        self.seen = 0
        self.history = torch.zeros(3)
        self.tags: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "history": self.history.clone(), "tags": list(self.tags)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen, self.history, self.tags = state["seen"], state["history"], state["tags"]


def test_a_custom_stateful_object_and_plain_values_round_trip(tmp_path: Path) -> None:
    saved = Counter()
    saved.seen, saved.tags = 7, ["a", "b"]
    saved.history = torch.tensor([1.5, -2.0, 3.25])
    ema = torch.arange(4.0)
    checkpoint.save(
        tmp_path, 2, objects={"counter": saved, "ema": ema, "epoch": 3, "cfg": {"k": (1, 2)}}
    )
    counter, into = Counter(), torch.zeros(4)
    objects: dict[str, Any] = {"counter": counter, "ema": into, "epoch": 0, "cfg": None}
    checkpoint.load(tmp_path, objects=objects, rng=False)
    assert counter.seen == 7 and counter.tags == ["a", "b"]
    assert torch.equal(counter.history, saved.history)
    assert objects["ema"] is into and torch.equal(into, ema)  # copied in place
    assert objects["epoch"] == 3 and objects["cfg"] == {"k": (1, 2)}  # replaced, as DCP does


def test_an_object_without_state_is_named(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError, match=r"save\(objects\['lock'\]=<object object at .*state_dict\(\)"
    ):
        checkpoint.save(tmp_path, 0, objects={"lock": object()})
    with pytest.raises(
        TypeError, match=r"save\(objects\['x'\]\) key 'f' holds a builtins.builtin_function"
    ):
        checkpoint.save(tmp_path, 0, objects={"x": {"f": len}})
    with pytest.raises(TypeError, match=r"load\(objects\['lock'\]=<object .*load_state_dict\(\)"):
        checkpoint.load(tmp_path, objects={"lock": object()})
    with pytest.raises(TypeError, match=r"save\(objects=\[1\]\): objects must be a dict"):
        checkpoint.save(tmp_path, 0, objects=[1])  # type: ignore[arg-type]
    assert checkpoint.latest(tmp_path) is None  # nothing was written


def test_a_tensor_of_another_shape_is_refused_naming_the_file(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, 0, objects={"ema": torch.ones(2)})
    with pytest.raises(checkpoint.CheckpointError, match=r"objects\.json: object 'ema' was saved"):
        checkpoint.load(tmp_path, objects={"ema": torch.zeros(3)}, rng=False)
