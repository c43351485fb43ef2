"""What comes back from a sandboxed call: draining its pipes, checking its report records (HOST).

Leaf module (no project imports), used by the worker's per-call manager:

    child stdout / stderr / report pipes --drain (select, caps, wall timeout)--> bytes
    report bytes --parse_records (nonce, schema)--> records, forged count

`parse_records` is the one home of the record schema: a record of any other shape is
refused and counted as forged, so nothing downstream (summarize_tests, the verifier) ever
meets a field of an unexpected type.
"""
from __future__ import annotations

import json
import os
import select
import signal
import time

# The one schema of a report record (pytest_plugin._Reporter._emit): event -> field -> type.
_RECORD_FIELDS = {
    "start": {"pid": int},
    "test": {"id": str, "when": str, "outcome": str, "message": str, "pid": int},
    "end": {"exitstatus": int, "tampered": list, "pid": int},
}
_OUTCOMES = ("passed", "failed", "error", "skipped")


def well_formed(rec) -> bool:
    """Whether `rec` (nonce removed) has exactly the fields and types of its event."""
    fields = _RECORD_FIELDS.get(rec.get("event")) if isinstance(rec, dict) and isinstance(rec.get("event"), str) else None
    if fields is None or set(rec) != {"event", *fields}:
        return False
    if any(not isinstance(rec[k], t) or isinstance(rec[k], bool) for k, t in fields.items()):
        return False
    if rec["event"] == "test" and rec["outcome"] not in _OUTCOMES:
        return False
    return rec["event"] != "end" or all(isinstance(x, str) for x in rec["tampered"])


def parse_records(data: bytes, nonce: str) -> tuple[list[dict], int]:
    """Report bytes -> (well-formed records carrying `nonce`, number of other lines)."""
    tests, forged = [], 0
    for line in data.decode(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # "[" * 100000 must not become a sandbox error
            rec = None
        if isinstance(rec, dict) and rec.pop("nonce", None) == nonce and well_formed(rec):
            tests.append(rec)
        else:
            forged += 1
    return tests, forged


def drain(pid: int, fds: list[int], timeout: float, limit: int, on_exit=None):
    """Read `fds` until child `pid` exits or the wall `timeout`; kill its process group on
    timeout. Returns (bufs, timed_out, status).

    `on_exit()` runs once the child is gone, before the last buffered bytes are read:
    grandchildren may still hold the pipes, so it kills them. Each buffer keeps at most
    `limit + 1` bytes (the report pipe 4 MiB), so a flood costs nothing but the cap.
    The fds are closed on return.
    """
    caps = [limit + 1, limit + 1, 4 << 20][:len(fds)]
    bufs = [bytearray() for _ in fds]
    pidfd = os.pidfd_open(pid)
    deadline = time.monotonic() + timeout
    open_fds, timed_out, status = list(fds), False, None
    try:
        while status is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                killpg(pid)
                _, status = os.waitpid(pid, 0)
                break
            ready, _, _ = select.select(open_fds + [pidfd], [], [], remaining)
            for fd in ready:
                if fd == pidfd:
                    _, status = os.waitpid(pid, 0)
                    continue
                chunk = os.read(fd, 65536)
                i = fds.index(fd)
                if not chunk:
                    open_fds.remove(fd)
                elif len(bufs[i]) < caps[i]:
                    bufs[i] += chunk[: caps[i] - len(bufs[i])]
        if on_exit is not None:
            on_exit()
        for fd in open_fds:
            i = fds.index(fd)
            os.set_blocking(fd, False)
            try:
                while len(bufs[i]) < caps[i] and (chunk := os.read(fd, 65536)):
                    bufs[i] += chunk[: caps[i] - len(bufs[i])]
            except BlockingIOError:
                pass
    finally:
        for fd in fds + [pidfd]:
            os.close(fd)
    return [bytes(b) for b in bufs], timed_out, status


def killpg(pid: int) -> None:
    """SIGKILL the process group of `pid` (gone already: nothing to do)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
