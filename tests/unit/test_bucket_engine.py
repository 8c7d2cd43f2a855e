"""The bucket engine, the coalescing helper and the sync switch: pure, one process."""

from __future__ import annotations

import pytest
import torch

from phalanx.data_parallel.bucket_engine import BucketEngine
from phalanx.data_parallel.coalesce import copy_back, flatten, group_by_kind, unflatten
from phalanx.data_parallel.sync_flag import sync_off


class Recorder:
    """A collective that records launches and completions; bucket ``skip`` sends nothing."""

    def __init__(self, skip: int = -1) -> None:
        self.events: list[tuple[str, int]] = []
        self.skip = skip

    def launch(self, bucket: int) -> str | None:
        self.events.append(("launch", bucket))
        return None if bucket == self.skip else f"handle{bucket}"

    def complete(self, bucket: int, handle: str) -> None:
        assert handle == f"handle{bucket}"
        self.events.append(("complete", bucket))


def test_buckets_launch_in_order_whatever_order_gradients_arrive() -> None:
    rec = Recorder()
    engine = BucketEngine([2, 1, 1], rec)
    engine.ready(2)  # complete, but buckets 0 and 1 are not: nothing may go out yet
    engine.ready(1)
    assert rec.events == [] and engine.launched == 0
    engine.ready(0)
    assert rec.events == [] and engine.pending == [1, 0, 0]
    engine.ready(0)
    assert rec.events == [("launch", 0), ("launch", 1), ("launch", 2)]
    engine.wait_all()
    assert rec.events[3:] == [("complete", 0), ("complete", 1), ("complete", 2)]
    assert engine.in_flight() == []


def test_each_handle_is_waited_once_and_skipped_buckets_not_at_all() -> None:
    rec = Recorder(skip=1)
    engine = BucketEngine([1, 1, 1], rec)
    engine.launch_all()
    assert engine.in_flight() == ["handle0", "handle2"]
    engine.wait(2)
    engine.wait(2)  # already completed: nothing more
    engine.wait(1)  # sent nothing: nothing to wait for
    engine.wait_all()
    assert [e for e in rec.events if e[0] == "complete"] == [("complete", 2), ("complete", 0)]


def test_max_in_flight_completes_the_oldest_before_launching() -> None:
    rec = Recorder()
    engine = BucketEngine([1, 1, 1, 1], rec, max_in_flight=2)
    engine.launch_all()
    assert rec.events == [
        ("launch", 0),
        ("launch", 1),
        ("complete", 0),
        ("launch", 2),
        ("complete", 1),
        ("launch", 3),
    ]
    assert engine.in_flight() == ["handle2", "handle3"]


def test_mark_complete_launch_ready_and_reset() -> None:
    rec = Recorder()
    engine = BucketEngine([3, 1], rec)
    engine.ready(1)
    engine.mark_complete(0)  # e.g. its parameters are unused everywhere
    assert engine.launched == 2
    engine.reset()
    assert engine.launched == 0 and engine.pending == [3, 1] and engine.in_flight() == []
    engine.launch_ready()
    assert engine.launched == 0


def test_no_double_launch_and_no_over_counting() -> None:
    engine = BucketEngine([1, 1], Recorder())
    engine.ready(0)
    with pytest.raises(AssertionError, match="bucket 0 launched twice or out of order"):
        engine._launch(0)
    with pytest.raises(AssertionError, match="bucket 0: 1 more ready than its 1"):
        engine.ready(0)


@pytest.mark.parametrize(
    ("sizes", "max_in_flight", "match"),
    [([1, -1], None, r"sizes must be ints >= 0, got \[1, -1\]"), ([1], 0, "got 0")],
)
def test_engine_rejects_bad_arguments(sizes: list[int], max_in_flight: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BucketEngine(sizes, Recorder(), max_in_flight)


def test_group_by_kind_keeps_first_seen_order() -> None:
    ts = [torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.zeros(2), torch.zeros(0)]
    assert group_by_kind(ts) == [[0, 2, 3], [1]]
    assert group_by_kind(ts, key=lambda t: t.numel()) == [[0, 1], [2], [3]]


def test_flatten_unflatten_and_copy_back_round_trip() -> None:
    a, b = torch.arange(6.0).view(2, 3), torch.tensor([7.0, 8.0])
    flat = flatten([a, b])
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 8.0]
    pieces = unflatten(flat, [a, b])
    assert pieces[0].shape == (2, 3) and pieces[0].data_ptr() == flat.data_ptr()
    assert flatten([a], dtype=torch.float16).dtype == torch.float16
    copy_back(flat * 2, [a, b])
    assert a.flatten().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0] and b.tolist() == [14.0, 16.0]


def test_coalesce_errors_name_the_sizes() -> None:
    with pytest.raises(ValueError, match="tensors must not be empty"):
        flatten([])
    with pytest.raises(ValueError, match=r"flat has 3 elements, the tensors 4 \(\[2, 2\]\)"):
        unflatten(torch.zeros(3), [torch.zeros(2), torch.zeros(2)])


def test_sync_off_switches_the_flag_and_restores_it_on_error() -> None:
    class Owner:
        require_backward_grad_sync = True

    owner = Owner()
    with pytest.raises(KeyError), sync_off(owner):
        assert owner.require_backward_grad_sync is False
        raise KeyError("inside")
    assert owner.require_backward_grad_sync is True
    owner.require_backward_grad_sync = False
    with sync_off(owner):
        pass
    assert owner.require_backward_grad_sync is False  # the previous value, not True
