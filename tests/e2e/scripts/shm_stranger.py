"""A local process without the job secret that races every shm key of a running job's store.

Usage: shm_stranger.py AGENT_PORT SECONDS READY_FILE DECOY_DIR

It reads the worker store's port from the agent store (as ``stranger.py`` does), makes decoy
files of its own (one named exactly like a phalanx segment in /dev/shm, one elsewhere), says it
is ready, and then, for every group prefix it sees or can guess (``N//cpu//``), writes first
(compare-and-set while absent) into each key the shm backend reads: segment records that point
at its decoys (by name, absolute path, ``..`` path, another process's descriptor), in each
disguise (a made-up signature, unsigned, raw), valid records replayed from another group, rank
records naming its own pid, mapped records, shared-buffer requests, and the counter that used
to decide who unlinks. Prints the keys it forged, one per line; the decoys' paths go in
DECOY_DIR/decoys.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time
from pathlib import Path

import torch.distributed as dist
from stranger import _connect, _forgeries, _worker_port

SHM = re.compile(r"^(.*?)phalanx_shm(?:_meet/|_buffer/\d+/)?/?")


def _decoys(directory: Path) -> list[str]:
    named = Path("/dev/shm") / f"phalanx-shm-{os.getuid()}-{secrets.token_hex(8)}"
    other = directory / "decoy"
    for path in (named, other):
        path.write_bytes(b"stranger's own bytes" * 100)
        path.chmod(0o600)
    (directory / "decoys").write_text(f"{named}\n{other}\n")
    return [str(named), str(other)]


def _handles(decoys: list[str], fd: int, nonces: list[str]) -> list[dict[str, object]]:
    """Segment records pointing at the decoys; ``fd`` is this process's descriptor of one."""
    st = os.fstat(fd)
    base = {"pid": os.getpid(), "fd": fd, "dev": st.st_dev, "ino": st.st_ino, "nbytes": 2000}
    names = [os.path.basename(decoys[0]), decoys[1], "../../" + decoys[1].lstrip("/")]
    out = [{**base, "kind": kind, "name": n} for kind in ("file", "memfd") for n in names]
    return [{"nonces": nonces, "handle": h, "error": ""} for h in out]


def _prefixes(keys: list[str]) -> set[str]:
    seen = set()
    for key in keys:
        m = SHM.match(key)
        if m and "phalanx_shm" in key:
            seen.add(m.group(1))
    guessed = {f"{n}//cpu//" for n in range(1, 5)}
    return seen | guessed


def _nonces(store: dist.TCPStore, prefix: str, size: int) -> list[str]:
    out = []
    for r in range(size):
        key = f"{prefix}phalanx_shm_meet//phalanx_shm/host/{r}"
        try:
            if store.check([key]):
                out.append(json.loads(store.get(key).decode().split(" ", 2)[2]).get("nonce", ""))
        except (ValueError, IndexError, RuntimeError):
            pass
    return out or ["x"] * size


def _preempt(store: dist.TCPStore, key: str, raw: str, forged: set[str]) -> None:
    if store.compare_set(key, "", raw) == raw.encode():
        forged.add(re.sub(r"^\d+//", "N//", key))


def _round(store: dist.TCPStore, n: int, decoys: list[str], fd: int, forged: set[str]) -> None:
    keys = [k for k in store.list_keys() if "phalanx_shm" in k]
    valid = [store.get(k).decode() for k in keys if k.endswith("phalanx_shm/made")]
    for prefix in _prefixes(keys):
        nonces = _nonces(store, prefix, 3)
        records = _handles(decoys, fd, nonces)
        for seg in ("phalanx_shm/", *(f"phalanx_shm_buffer/{b}/phalanx_shm/" for b in (1, 2))):
            made = _forgeries(records[n % len(records)])[n % 4]
            _preempt(store, prefix + seg + "made", made, forged)
            for replay in valid:  # another group's real record
                _preempt(store, prefix + seg + "made", replay, forged)
            _preempt(store, prefix + seg + "name", decoys[n % 2], forged)  # the old key
            store.add(prefix + seg + "mapped", 1)  # the old unlink counter
            for r in range(3):
                mapped = {"nonce": nonces[r % len(nonces)], "error": ""}
                _preempt(store, f"{prefix}{seg}mapped/{r}", _forgeries(mapped)[n % 4], forged)
        for r in range(3):
            host = {"pid": os.getpid(), "start": 1, "host": "evil", "nonce": "n"}
            key = f"{prefix}phalanx_shm_meet//phalanx_shm/host/{r}"
            _preempt(store, key, _forgeries(host)[n % 4], forged)
            for b in (1, 2):
                asked = _forgeries(["n", "99 x float32"])[n % 4]
                _preempt(store, f"{prefix}phalanx_shm_buffer/{b}/asked/{r}", asked, forged)


def main() -> None:
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    ready, directory = Path(sys.argv[3]), Path(sys.argv[4])
    deadline = time.monotonic() + seconds
    forged: set[str] = set()
    agent = _connect(port)
    worker = _connect(_worker_port(agent, deadline))
    decoys = _decoys(directory)
    fd = os.open(decoys[1], os.O_RDONLY)  # held open: /proc/<this pid>/fd/<fd> is a decoy
    ready.touch()
    n = 0
    try:
        while time.monotonic() < deadline:
            _round(worker, n, decoys, fd, forged)
            n += 1
    except Exception as exc:  # the job ended and its store with it
        print(f"stranger stopped: {type(exc).__name__}", file=sys.stderr)
    print("\n".join(sorted(forged)), flush=True)


if __name__ == "__main__":
    main()
