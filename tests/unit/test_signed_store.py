"""Signed store values: forged, replayed, junk and mixed-secret values are refused, once logged."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch.distributed as dist

from phalanx.comm import join
from phalanx.comm.signed import JobSecretError, Rejected, SignedStore, as_record

SECRET = b"a" * 64


def _signer(secret: bytes | None = SECRET, scope: str = "job1/0") -> SignedStore:
    return SignedStore(dist.HashStore(), secret, scope)


def test_round_trip_and_frame() -> None:
    s = _signer()
    s.put("k", {"x": [1, 2.5, "é"], "ok": True})
    assert s.get("k") == {"x": [1, 2.5, "é"], "ok": True}
    raw = s.store.get("k").decode()
    assert raw.startswith("phx1 ") and len(raw.split(" ")[1]) == 64
    assert s.get("absent") is None


def test_a_value_is_bound_to_its_key_scope_and_secret() -> None:
    s = _signer()
    s.put("a", 1)
    raw = s.store.get("a")
    s.store.set("b", raw)  # replayed under another key
    assert s.get("b") is None
    assert SignedStore(s.store, SECRET, "job2/0").get("a") is None  # another job / generation
    assert SignedStore(s.store, b"b" * 64, "job1/0").get("a") is None  # another secret
    assert s.sub("p/").get("a") is None and s.get("a") == 1


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"junk",
        b"\xff\xfe",
        b"phx1 - 1",
        b"phx1 zz 1",
        b"phx1 " + b"0" * 64 + b" 1",
        b"phx1 " + b"0" * 64 + b" [[[[",
        b'{"ok": true}',
    ],
)
def test_junk_and_forgeries_read_as_absent(raw: bytes) -> None:
    s = _signer()
    s.store.set("k", raw)
    assert s.get("k") is None
    with pytest.raises(Rejected):
        s.decode("k", raw)


def test_a_rejected_key_is_logged_once_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    s = _signer(scope="once")
    s.store.set("phalanx/hang/req/0", "junk")
    with caplog.at_level(logging.WARNING, logger="phalanx.comm.signed"):
        for _ in range(3):
            assert s.get("phalanx/hang/req/0") is None
    assert len(caplog.records) == 1
    assert "'phalanx/hang/req/0'" in caplog.text and "not a phalanx value" in caplog.text


def test_mixed_secrets_fail_closed() -> None:
    unsigned, signed = _signer(None), _signer()
    unsigned.put("k", 1)
    assert unsigned.get("k") == 1  # no secret: framed, accepted
    with pytest.raises(Rejected, match="unsigned, but this process has a PHALANX_JOB_SECRET"):
        signed.decode("k", unsigned.store.get("k"))
    signed.put("k", 1)
    with pytest.raises(Rejected, match="signed, but PHALANX_JOB_SECRET is not set"):
        unsigned.decode("k", signed.store.get("k"))


def test_first_replaces_junk_but_keeps_a_valid_first_value() -> None:
    s = _signer()
    s.store.set("f", b"\xff junk")
    assert s.first("f", {"who": 1}) == {"who": 1}
    assert s.first("f", {"who": 2}) == {"who": 1}


def test_wait_get_skips_a_forgery_until_the_real_value_comes() -> None:
    s = _signer()
    s.store.set("w", "phx1 " + "1" * 64 + ' {"ok": true, "files": {"evil": 1}}')

    def real() -> None:
        time.sleep(0.3)
        s.put("w", {"ok": True})

    t = threading.Thread(target=real)
    t.start()
    assert s.wait_get("w", timedelta(seconds=10)) == {"ok": True}
    t.join()
    with pytest.raises(TimeoutError):
        s.wait_get("never", timedelta(seconds=0.1))


@dataclass(frozen=True)
class _Rec:
    n: int
    name: str
    when: float
    note: str | None = None


def test_as_record_checks_names_and_types() -> None:
    assert as_record(_Rec, {"n": 1, "name": "a", "when": 2}) == _Rec(1, "a", 2)
    for bad in (
        [1],
        {"n": "1", "name": "a", "when": 2.0},
        {"n": True, "name": "a", "when": 1},
        {"n": 1, "name": "a"},
        {"n": 1, "name": "a", "when": 1, "x": 0},
        {"n": 1, "name": "a", "when": 1, "note": 3},
    ):
        with pytest.raises(TypeError):
            as_record(_Rec, bad)


def test_join_refuses_another_jobs_secret_naming_job_and_store() -> None:
    store = dist.HashStore()
    nonce = join.host_job(store, SECRET, "run-7", 0, "10.1.2.3:4567")
    assert join.join_job(store, SECRET, 1, "run-7", 0, "x", timedelta(seconds=1)) == nonce
    for theirs in (b"b" * 64, None):
        with pytest.raises(JobSecretError) as err:
            join.join_job(store, theirs, 1, "run-7", 0, "10.1.2.3:4567", timedelta(seconds=1))
        assert "rank 1 on " in str(err.value)
        assert "cannot join job 'run-7' through its worker store at 10.1.2.3:4567" in str(err.value)
    with pytest.raises(JobSecretError, match="started for job 'other'"):
        join.join_job(store, SECRET, 1, "other", 0, "h:1", timedelta(seconds=1))


def test_the_host_counts_only_valid_proofs() -> None:
    store = dist.HashStore()
    job = SignedStore(store, SECRET, "n/0")
    join.prove(job, 0)
    store.set(join.proof_key(1), "phx1 - " + '{"rank": 1, "host": "evil", "pid": 1}')
    assert join.proven(job, [0, 1]) == [0]
    join.prove(job.over(store), 1)
    assert join.proven(job, [0, 1]) == [0, 1]
