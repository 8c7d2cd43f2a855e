"""``Job.progress`` moves batches of any structure to the job's device (``to_device``).

CI has no GPU, so the moves go to torch's ``meta`` device: a tensor that was moved reports
``device.type == "meta"``, one that was missed stays on the CPU. The structure (types, keys,
order, non-tensor leaves) must come back unchanged.
"""

from __future__ import annotations

from collections import OrderedDict, UserDict, namedtuple
from typing import Any, NamedTuple

import pytest
import torch

from phalanx.train.loop_helpers import batch_len, to_device

META = torch.device("meta")


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class Encoding(UserDict[str, Any]):
    """A ``BatchEncoding``-like mapping: a ``UserDict`` subclass with attributes of its own."""

    def __init__(self, data: dict[str, Any], note: str) -> None:
        super().__init__(data)
        self.note = note


def _on_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def test_a_namedtuple_comes_back_as_itself_on_the_device() -> None:
    moved = to_device(Pair(torch.ones(3, 2), torch.zeros(3)), META)
    assert type(moved) is Pair and _on_meta(moved.x) and _on_meta(moved.y)
    assert moved.x.shape == (3, 2) and batch_len(moved) == 3


def test_a_collections_namedtuple_nested_in_a_list() -> None:
    Row = namedtuple("Row", "ids mask label")
    moved = to_device([Row(torch.ones(2), torch.ones(2), "a")], META)
    assert type(moved) is list and type(moved[0]) is Row
    assert _on_meta(moved[0].ids) and _on_meta(moved[0].mask) and moved[0].label == "a"


def test_a_user_dict_subclass_keeps_its_class_and_attributes() -> None:
    batch = Encoding({"input_ids": torch.ones(4, 5), "text": ["a"] * 4}, note="kept")
    moved = to_device(batch, META)
    assert type(moved) is Encoding and moved.note == "kept"
    assert _on_meta(moved["input_ids"]) and moved["text"] == ["a"] * 4
    assert batch["input_ids"].device.type == "cpu", "the caller's batch is not changed"
    assert batch_len(moved) == 4


def test_nested_dicts_lists_and_tuples() -> None:
    batch = {
        "x": (torch.ones(2), [torch.ones(2), 3]),
        "extra": OrderedDict(m=torch.ones(1), n=None),
        "enc": [Encoding({"a": torch.ones(6)}, note="n")],
    }
    moved = to_device(batch, META)
    assert type(moved) is dict and list(moved) == ["x", "extra", "enc"]
    assert type(moved["x"]) is tuple and type(moved["x"][1]) is list
    assert _on_meta(moved["x"][0]) and _on_meta(moved["x"][1][0]) and moved["x"][1][1] == 3
    assert type(moved["extra"]) is OrderedDict and _on_meta(moved["extra"]["m"])
    assert moved["extra"]["n"] is None
    assert type(moved["enc"][0]) is Encoding and _on_meta(moved["enc"][0]["a"])
    assert batch_len(moved) == 2


def test_a_transformers_batch_encoding() -> None:
    transformers = pytest.importorskip("transformers")
    batch = transformers.BatchEncoding({"input_ids": torch.ones(3, 4, dtype=torch.long)})
    moved = to_device(batch, META)
    assert type(moved) is transformers.BatchEncoding
    assert _on_meta(moved["input_ids"]) and _on_meta(moved.input_ids)
    assert batch["input_ids"].device.type == "cpu"
    assert batch_len(moved) == 3


def test_a_plain_tensor_and_leaves_without_tensors() -> None:
    assert _on_meta(to_device(torch.ones(2), META))
    assert to_device("text", META) == "text" and batch_len("text") == 1
    assert batch_len(torch.tensor(3.0)) == 1  # a 0-d tensor has no batch dimension
