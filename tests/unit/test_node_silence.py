"""``PHALANX_NODE_SILENCE_TIMEOUT``: how long node 0 waits for a silent node agent."""

from __future__ import annotations

import pytest

from phalanx.launch.agent import PEER_SILENCE_TIMEOUT_S, node_silence_timeout


def test_default_and_a_given_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_NODE_SILENCE_TIMEOUT", raising=False)
    assert node_silence_timeout() == PEER_SILENCE_TIMEOUT_S == 30.0
    monkeypatch.setenv("PHALANX_NODE_SILENCE_TIMEOUT", " ")  # blank: as unset
    assert node_silence_timeout() == 30.0
    monkeypatch.setenv("PHALANX_NODE_SILENCE_TIMEOUT", "7.5")
    assert node_silence_timeout() == 7.5


@pytest.mark.parametrize("bad", ["0", "-3", "soon", "nan"])
def test_a_bad_value_is_named(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("PHALANX_NODE_SILENCE_TIMEOUT", bad)
    with pytest.raises(ValueError, match=rf"PHALANX_NODE_SILENCE_TIMEOUT={bad!r} (is not|must)"):
        node_silence_timeout()
