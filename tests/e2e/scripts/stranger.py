"""A local process without the job secret that writes into a running job's stores.

Usage: stranger.py AGENT_PORT SECONDS

It does what issue 14's stranger did, and more: junk and forged failure records in the agent
store; in the worker store (whose port it reads from the agent store), forged checkpoint-session
answers for every session it sees, junk hang incidents, answers and reports, a forged mismatch
finding, junk rank identities and progress. It
writes a key that a rank will write only while the key is absent (compare-and-set), so it forges
first and never merely overwrites: overwriting or deleting keys is a denial of service that
phalanx does not claim to prevent. Prints the names of the keys it forged, one per line.
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import timedelta

import torch.distributed as dist

FAKE_TAG = "ab" * 32
FAILURE = {"rank": 1, "local_rank": 1, "node_rank": 0, "pid": 1, "returncode": 1}
FAILURE.update(exception="Forged: a stranger wrote this", last_line=None, reason=None)
ANSWERS = {
    "written/1": {"ok": True, "files": {"evil.safetensors": {"sha256": "0" * 64, "bytes": 1}}},
    "committed": {"ok": True, "path": "/tmp/evil"},
    "loaded/0": {"ok": False, "error": "forged"},
    "loaded/1": {"ok": False, "error": "forged"},
    "closed/0": {"ok": True},
    "closed/1": {"ok": True},
    "chosen": {"ok": True, "value": "/tmp/evil"},
}


def _connect(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))


def _forgeries(value: object) -> list[str]:
    text = json.dumps(value)
    return [f"phx1 {FAKE_TAG} {text}", f"phx1 - {text}", text, "\xff junk"]


def _preempt(store: dist.TCPStore, key: str, value: object, forged: set[str], n: int) -> None:
    """Write a forgery at ``key`` only while nobody has written it (never overwrite)."""
    forgery = _forgeries(value)[n % 4]
    if store.compare_set(key, "", forgery) == forgery.encode():
        forged.add(re.sub(r"checkpoint/[0-9a-f]+/", "checkpoint/<token>/", key))


def _agent_junk(agent: dist.TCPStore, n: int, forged: set[str]) -> None:
    """A failure record for generation 0 (no real one is ever written in these jobs): junk, then
    a forged one in each disguise (issue 14's stopped the job in 0.7 s, blaming rank 1)."""
    junk = ["junk that crashed the launcher", *_forgeries(FAILURE)]
    agent.set("phalanx/g0/failure", junk[n % len(junk)])
    agent.compare_set("phalanx/g0/done/0", "", "1")  # "node 0 is done" before it is
    forged.update({"phalanx/g0/failure", "phalanx/g0/done/0"})


def _worker_port(agent: dist.TCPStore, deadline: float) -> int:
    while time.monotonic() < deadline:
        if agent.check(["phalanx/g0/worker_port"]):  # a signed frame, but readable by anyone
            return int(agent.get("phalanx/g0/worker_port").decode().split(" ", 2)[2])
        time.sleep(0.01)
    raise SystemExit("stranger: no worker port")


def _round(store: dist.TCPStore, n: int, forged: set[str]) -> None:
    for key in store.list_keys():
        m = re.match(r"(.*phalanx/checkpoint/[0-9a-f]+/)", key)
        if m:
            for name, value in ANSWERS.items():
                _preempt(store, m.group(1) + name, value, forged, n)
    answer = {"at": 0, "in_flight": None, "stack": ["forged"], "records": []}
    for r in (0, 1):
        incident = {"n": r + 1, "opener": 1 - r, "at": 0.0, "stuck": {}}
        _preempt(store, f"phalanx/hang/incident/{r + 1}", incident, forged, n)
        _preempt(store, f"phalanx/hang/answer/1/{r}", answer, forged, n)
        _preempt(store, f"phalanx/progress/{r}", {"default_pg": [10**9, "x"]}, forged, n)
        _preempt(
            store, f"phalanx/who/{r}", {"host": "evil", "pid": 1, "dir": "/", "main": 0}, forged, n
        )
    _preempt(store, "phalanx/hang/report/1", {"text": "forged report"}, forged, n)
    _preempt(store, "phalanx/mismatch", {"text": "forged mismatch"}, forged, n)
    _preempt(store, "phalanx/files/token", "0123456789abcdef", forged, n)
    store.set("phalanx/hang/who", "x")  # issue 14: two writes that killed the hang thread
    store.add("phalanx/hang/count", 1)
    store.add("phalanx/hang/bell", 1)
    forged.update({"phalanx/hang/who", "phalanx/hang/count", "phalanx/hang/bell"})


def main() -> None:
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    deadline = time.monotonic() + seconds
    forged: set[str] = set()
    agent = _connect(port)
    _agent_junk(agent, 0, forged)
    worker = _connect(_worker_port(agent, deadline))
    worker.set("stranger/connected", "1")  # the job (WAIT_FOR_STRANGER=1) saves from now on
    n = 0
    try:
        while time.monotonic() < deadline:
            if n % 25 == 0:
                _agent_junk(agent, n // 25, forged)
            _round(worker, n, forged)
            n += 1
            time.sleep(0.002)
    except Exception as exc:  # the job ended and its stores with it
        print(f"stranger stopped: {type(exc).__name__}", file=sys.stderr)
    print("\n".join(sorted(forged)), flush=True)


if __name__ == "__main__":
    main()
