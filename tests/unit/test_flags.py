"""The tracking flags of the environment: one boolean parser, every flag read at once."""

from __future__ import annotations

import pytest

from phalanx.comm.flags import TrackingFlags, env_flag, hang_timeout, tracking_flags


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_true_spellings(raw: str) -> None:
    assert env_flag("F", False, {"F": raw}) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "NO", "off"])
def test_false_spellings(raw: str) -> None:
    assert env_flag("F", True, {"F": raw}) is False


@pytest.mark.parametrize("raw", [None, "", "  "])
def test_unset_or_empty_is_the_default(raw: str | None) -> None:
    env = {} if raw is None else {"F": raw}
    assert env_flag("F", True, env) is True and env_flag("F", False, env) is False


def test_a_bad_flag_names_the_variable_and_the_value_as_typed() -> None:
    with pytest.raises(ValueError, match=r"environment variable F=' Maybe' is not a boolean"):
        env_flag("F", True, {"F": " Maybe"})


def test_tracking_flags_reads_every_flag() -> None:
    assert tracking_flags({}) == TrackingFlags()
    env = {
        "PHALANX_MISMATCH_CHECK": "off",
        "PHALANX_CALL_SITES": "no",
        "PHALANX_HANG_TIMEOUT": "2.5",
        "PHALANX_DEBUG": "1",
    }
    assert tracking_flags(env) == TrackingFlags(False, False, 2.5, True)


@pytest.mark.parametrize(("raw", "words"), [("soon", "not a number"), ("0", "> 0"), ("nan", "> 0")])
def test_hang_timeout_is_validated(raw: str, words: str) -> None:
    assert hang_timeout({"PHALANX_HANG_TIMEOUT": "2.5"}) == 2.5
    with pytest.raises(ValueError, match=f"PHALANX_HANG_TIMEOUT='{raw}'.*{words}"):
        hang_timeout({"PHALANX_HANG_TIMEOUT": raw})
