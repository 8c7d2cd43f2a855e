"""The pure parts of the ring and tree algorithms: chunk layout, schedules, topologies, ops."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed import ReduceOp

from phalanx.comm.algorithms import (
    binomial_tree,
    chain,
    chunk_spans,
    combiner,
    piece_spans,
    ring_schedule,
)


@pytest.mark.parametrize("numel", [0, 1, 2, 5, 7, 1003])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5, 8])
def test_chunk_spans_match_tensor_split(numel: int, parts: int) -> None:
    t = torch.arange(numel)
    want = [(int(c[0]), int(c[-1]) + 1) if c.numel() else None for c in t.tensor_split(parts)]
    got = chunk_spans(numel, parts)
    assert len(got) == parts
    assert [s if s[1] > s[0] else None for s in got] == want
    assert got[0][0] == 0 and got[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(got))


@pytest.mark.parametrize(("numel", "max_elems"), [(0, 4), (1, 4), (4, 4), (5, 4), (1003, 100)])
def test_piece_spans_cover_with_fewest_balanced_pieces(numel: int, max_elems: int) -> None:
    spans = piece_spans(numel, max_elems)
    assert len(spans) == math.ceil(numel / max_elems)
    sizes = [b - a for a, b in spans]
    assert sum(sizes) == numel and all(0 < s <= max_elems for s in sizes)
    assert not sizes or max(sizes) - min(sizes) <= 1


def test_spans_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="parts=0"):
        chunk_spans(4, 0)
    with pytest.raises(ValueError, match="max_elems must be >= 1, got 0"):
        piece_spans(4, 0)


def _simulate_ring(world: int) -> list[list[set[int]]]:
    """Run every rank's schedule on sets of contributors; return what each rank holds."""
    held = [[{r} for _ in range(world)] for r in range(world)]
    schedules = [ring_schedule(world, r) for r in range(world)]
    for s in range(2 * (world - 1)):
        sent = [set(held[r][schedules[r][s].send]) for r in range(world)]
        for r in range(world):
            step = schedules[r][s]
            left = (r - 1) % world
            assert schedules[left][s].send == step.recv, "left sends the chunk this rank expects"
            if step.phase == "reduce_scatter":
                held[r][step.recv] |= sent[left]
            else:
                held[r][step.recv] = sent[left]
    return held


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_ring_schedule_reduces_everything_everywhere(world: int) -> None:
    held = _simulate_ring(world)
    assert all(chunk == set(range(world)) for rank in held for chunk in rank)
    for r in range(world):
        steps = ring_schedule(world, r)
        assert len(steps) == 2 * (world - 1)
        rs = steps[: world - 1]
        assert not rs or rs[-1].recv == r, "reduce-scatter ends with rank r owning chunk r"
        # pipelining: what a rank finishes at one step is what it sends at the next
        assert all(a.recv == b.send for a, b in itertools.pairwise(steps))


def test_ring_schedule_rejects_bad_rank() -> None:
    with pytest.raises(ValueError, match="rank=3, world=3"):
        ring_schedule(3, 3)


def _depth(links: list, rank: int) -> int:  # type: ignore[type-arg]
    d = 0
    while links[rank].parent is not None:
        rank, d = links[rank].parent, d + 1
    return d


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17])
@pytest.mark.parametrize("root_pick", ["first", "middle", "last"])
def test_binomial_tree_is_a_spanning_tree_of_log_depth(world: int, root_pick: str) -> None:
    root = {"first": 0, "middle": world // 2, "last": world - 1}[root_pick]
    links = binomial_tree(world, root)
    assert [r for r, lk in enumerate(links) if lk.parent is None] == [root]
    for r, lk in enumerate(links):
        if lk.parent is not None:
            assert r in links[lk.parent].children
        for c in lk.children:
            assert links[c].parent == r
    # rank v places from the root is popcount(v) hops down; never more than ceil(log2 world)
    depths = [_depth(links, r) for r in range(world)]
    assert depths == [bin((r - root) % world).count("1") for r in range(world)]
    assert max(depths) <= math.ceil(math.log2(world))
    # children nearest first: their distance from the parent doubles
    for r, lk in enumerate(links):
        dist = [(c - r) % world for c in lk.children]
        assert dist == [1 << k for k in range(len(dist))]


def test_binomial_tree_of_five() -> None:
    links = binomial_tree(5, 0)
    assert [lk.children for lk in links] == [(1, 2, 4), (), (3,), (), ()]
    assert [lk.parent for lk in links] == [None, 0, 0, 2, 0]


@pytest.mark.parametrize(("world", "root"), [(1, 0), (2, 1), (4, 2), (5, 0)])
def test_chain_visits_every_rank_once(world: int, root: int) -> None:
    links = chain(world, root)
    order, rank = [root], root
    while links[rank].children:
        (rank,) = links[rank].children
        order.append(rank)
    assert order == [(root + i) % world for i in range(world)]
    assert links[root].parent is None


def test_topologies_reject_bad_root() -> None:
    with pytest.raises(ValueError, match="root=4, world=4"):
        binomial_tree(4, 4)
    with pytest.raises(ValueError, match="root=-1"):
        chain(4, -1)


def test_combiner_applies_the_op() -> None:
    a, b = torch.tensor([1, 6, 3]), torch.tensor([4, 2, 3])
    for op, want in [
        (ReduceOp.SUM, [5, 8, 6]),
        (ReduceOp.PRODUCT, [4, 12, 9]),
        (ReduceOp.MIN, [1, 2, 3]),
        (ReduceOp.MAX, [4, 6, 3]),
        (ReduceOp.BAND, [0, 2, 3]),
        (ReduceOp.BOR, [5, 6, 3]),
        (ReduceOp.BXOR, [5, 4, 0]),
    ]:
        out = torch.empty(3, dtype=torch.int64)
        combiner(op, torch.int64)(a, b, out)
        assert out.tolist() == want, op


def test_combiner_on_bool_matches_gloo() -> None:
    a, b = torch.tensor([True, True, False, False]), torch.tensor([True, False, True, False])
    want = {
        ReduceOp.MIN: [True, False, False, False],
        ReduceOp.MAX: [True, True, True, False],
        ReduceOp.BAND: [True, False, False, False],
        ReduceOp.BOR: [True, True, True, False],
        ReduceOp.BXOR: [False, True, True, False],
    }
    for op, expected in want.items():
        out = torch.empty(4, dtype=torch.bool)
        combiner(op, torch.bool)(a, b, out)
        assert out.tolist() == expected, op


def test_combiner_rejects_what_the_backend_rejects() -> None:
    with pytest.raises(TypeError, match=r"ReduceOp.BAND .*torch.float32"):
        combiner(ReduceOp.BAND, torch.float32)
    with pytest.raises(TypeError, match=r"ReduceOp.BXOR .*torch.bfloat16"):
        combiner(ReduceOp.BXOR, torch.bfloat16)
    with pytest.raises(TypeError, match=r"ReduceOp.AVG .*torch.int64"):
        combiner(ReduceOp.AVG, torch.int64)
    with pytest.raises(TypeError, match=r"ReduceOp.AVG .*torch.bool"):
        combiner(ReduceOp.AVG, torch.bool)
    with pytest.raises(ValueError, match="PREMUL_SUM"):
        combiner(ReduceOp.PREMUL_SUM, torch.float32)
