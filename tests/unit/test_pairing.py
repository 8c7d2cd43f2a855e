"""The pairing rule: which positions are wrong, which differing call sites are legitimate."""

from __future__ import annotations

import pytest

from phalanx.comm.flags import sites_compared
from phalanx.diagnostics import fingerprint as fpr
from phalanx.diagnostics.flight import Record
from phalanx.diagnostics.pairing import first_mismatch


def _c(seq: int, site: str, op: str = "all_reduce", shape: str = "[4] float32", args: str = "SUM"):  # type: ignore[no-untyped-def]
    return Record("0", seq, op, shape, site, 0.0, args=args)


def _calls(*sites_by_rank: list[str]) -> dict[int, dict[int, Record]]:
    return {
        r: {i + 1: _c(i + 1, s) for i, s in enumerate(sites)}
        for r, sites in enumerate(sites_by_rank)
    }


def test_differing_signatures_are_wrong_at_their_position() -> None:
    calls = _calls(["a", "b"], ["a", "b"])
    calls[1][2] = _c(2, "b", args="MAX")
    div = first_mismatch(calls, "0")
    assert div is not None and div.seq == 2 and not div.skipped
    assert "collective #2 on group 0 diverges: rank(s) [0] issued" in div.describe()
    assert "(differing: reduce op/root)" in div.describe()


@pytest.mark.parametrize(
    ("field", "named"),
    [("op", "op"), ("shape", "shape/dtype"), ("args", "reduce op/root")],
)
def test_each_field_is_named(field: str, named: str) -> None:
    a, b = _c(1, "s"), _c(1, "s")
    setattr(b, field, "other")
    div = first_mismatch({0: {1: a}, 1: {1: b}}, "0")
    assert div is not None and f"(differing: {named})" in div.describe()


def test_a_rank_one_call_ahead_skipped_one() -> None:
    div = first_mismatch(_calls(["a", "extra", "b", "c"], ["a", "b", "c"]), "0")
    assert div is not None and div.seq == 2 and div.skipped and div.ahead == (1,)
    assert "rank(s) [1] skipped all_reduce [4] float32 SUM at extra" in div.describe()
    assert "The results of #2 are wrong" in div.describe()


def test_rank_dependent_sites_that_realign_are_legitimate() -> None:
    # if rank == 0: scatter(t, chunks, src=0) else: scatter(t, src=0), in a loop
    assert first_mismatch(_calls(["r0", "x", "r0", "x"], ["r1", "x", "r1", "x"]), "0") is None
    assert first_mismatch(_calls(["r0"] * 5, ["r1"] * 5), "0") is None
    # two such idioms in a row
    assert first_mismatch(_calls(["p0", "q0", "x"], ["p1", "q1", "x"]), "0") is None


def test_alternating_sources_with_their_roots_are_legitimate() -> None:
    # for i: if rank == i % 2: broadcast(t, src=i % 2) at L1 else: broadcast(buf, src=i % 2) at L2
    a = {i: _c(i, "L1" if i % 2 else "L2", "broadcast", args=f"root={i % 2}") for i in range(1, 7)}
    b = {i: _c(i, "L2" if i % 2 else "L1", "broadcast", args=f"root={i % 2}") for i in range(1, 7)}
    assert first_mismatch({0: a, 1: b}, "0") is None


def test_positions_not_reached_by_every_rank_are_not_wrong() -> None:
    assert first_mismatch(_calls(["a", "b", "c", "d"], ["a", "b"]), "0") is None
    # a skip is only known once the next call shows it
    assert first_mismatch(_calls(["a", "extra"], ["a", "b"]), "0") is None


def test_sites_off_ignores_skips_not_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _calls(["a", "extra", "b"], ["a", "b", "c"])
    assert first_mismatch(calls, "0", sites=False) is None
    monkeypatch.setenv("PHALANX_CALL_SITES", "0")
    assert not sites_compared()
    monkeypatch.setenv("PHALANX_CALL_SITES", "maybe")
    with pytest.raises(ValueError, match="PHALANX_CALL_SITES='maybe' is not a boolean"):
        sites_compared()


def test_three_ranks_two_behind() -> None:
    div = first_mismatch(_calls(["a", "x", "b"], ["a", "b", "c"], ["a", "x", "b"]), "0")
    assert div is not None and div.ahead == (1,) and sorted(div.following) == [0, 2]
    assert "rank(s) [0, 2] issued all_reduce [4] float32 SUM at x" in div.describe()


def test_fingerprints_pair_by_the_same_rule() -> None:
    import torch

    def fp(seq: int, site: str):  # type: ignore[no-untyped-def]
        return fpr.make("all_reduce", "0", seq, torch.ones(4), "SUM", None, True, site)

    calls = {0: {1: fpr.as_record(fp(1, "x")), 2: fpr.as_record(fp(2, "y"))}}
    calls[1] = {1: fpr.as_record(fp(1, "y")), 2: fpr.as_record(fp(2, "z"))}
    div = first_mismatch(calls, "0")
    assert (
        div is not None
        and div.skipped
        and div.issued[0].where() == "all_reduce [4] float32 SUM at x"
    )
    assert fpr.args_text(None, 0) == "root=0" and fpr.args_text("MAX", 1) == "MAX root=1"
