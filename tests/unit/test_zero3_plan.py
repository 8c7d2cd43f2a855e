"""ZeRO-3 planning: unit selection, parameter ownership (tied -> root), padding, shard pieces."""

from __future__ import annotations

import pytest
from torch import nn

from phalanx.sharding.pieces import Piece, pieces_in_range
from phalanx.sharding.zero3.plan import (
    assign_params,
    normalize_wrap,
    padded_size,
    select_units,
)


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.nested = nn.Sequential(nn.Linear(2, 2))


def _net() -> nn.Module:
    net = nn.Module()
    net.stem = nn.Linear(2, 2)
    net.a = _Inner()
    net.b = _Inner()
    net.head = nn.Linear(2, 2)
    return net


def test_padding_makes_equal_shards() -> None:
    assert [padded_size(n, 3) for n in (0, 1, 3, 251)] == [0, 3, 3, 252]
    assert padded_size(251, 2) == 252


def test_shard_pieces_cover_every_element_once() -> None:
    entries = [("w", (2, 3), 0), ("b", (3,), 6)]  # 9 elements, padded to 10 for 2 ranks
    assert pieces_in_range(entries, 0, 5) == [Piece("w", (2, 3), 0, 5, 0)]
    assert pieces_in_range(entries, 5, 10) == [
        Piece("w", (2, 3), 5, 6, 0),
        Piece("b", (3,), 0, 3, 1),
    ]
    for world in (1, 2, 3, 4, 9, 12):
        chunk = padded_size(9, world) // world
        got = sorted(
            (s.key, i)
            for r in range(world)
            for s in pieces_in_range(entries, r * chunk, (r + 1) * chunk)
            for i in range(s.start, s.end)
        )
        assert got == sorted([("w", i) for i in range(6)] + [("b", i) for i in range(3)])


def test_select_units_outermost_only_in_order() -> None:
    net = _net()
    chosen = select_units(net, normalize_wrap((_Inner, nn.Sequential)))
    assert [name for name, _ in chosen] == ["a", "b"]  # a.nested is inside unit a
    assert select_units(net, normalize_wrap(lambda m: isinstance(m, nn.Linear))) == [
        ("stem", net.stem),
        ("a.lin", net.a.lin),
        ("a.nested.0", net.a.nested[0]),
        ("b.lin", net.b.lin),
        ("b.nested.0", net.b.nested[0]),
        ("head", net.head),
    ]
    assert select_units(net, None) == []


def test_tied_parameters_across_units_belong_to_the_root() -> None:
    net = _net()
    net.b.lin.weight = net.a.lin.weight  # across units -> root
    net.head.weight = net.stem.weight  # inside the root
    net.a.nested[0].bias = net.a.lin.bias  # inside unit a -> stays in a
    per_unit, root = assign_params(net, ["a", "b"])
    keys = [[r.keys for r in refs] for refs in per_unit]
    assert keys[0] == [["a.lin.bias", "a.nested.0.bias"], ["a.nested.0.weight"]]
    assert keys[1] == [["b.lin.bias"], ["b.nested.0.weight"], ["b.nested.0.bias"]]
    assert [r.keys for r in root] == [
        ["stem.weight", "head.weight"],
        ["stem.bias"],
        ["a.lin.weight", "b.lin.weight"],
        ["head.bias"],
    ]
    shared = next(r for r in root if r.keys[0] == "a.lin.weight")
    assert [(m is net.a.lin, n) for m, n in shared.slots] == [(True, "weight"), (False, "weight")]


@pytest.mark.parametrize("bad", [42, (int,), (), "Block", [nn.Linear]])
def test_wrap_of_the_wrong_type_is_rejected(bad: object) -> None:
    with pytest.raises(TypeError, match="wrap="):
        normalize_wrap(bad)  # type: ignore[arg-type]
