"""One execution per distinct sandbox request: identical calls share a result (HOST, leaf).

A sandboxed call is a function of what it is given: the bytes of the workspace it copies
(regular files and directories, with their executable bits: `jail.copy_workspace`), the
command and the limits. The caller's directory is never changed by a call. In an RL batch
most calls repeat one another: a group's eight episodes run the same tests on the same
untouched code, and end with the same fix or none, so the verifier judges the same bytes
again and again (`benchmarks/bench_rollout.py` counts them). With a `CallMemo`, the first of
identical calls runs and the others get a copy of its result:

    Sandbox.run / judge(workspace, request)
      -> key = sha256(workspace_digest(workspace), request without the path)
      -> kept result?          yes: a copy of it
         same key in flight?   yes: wait for it, then its copy (or run, if it was not kept)
         else run; keep it if it is clean (no sandbox error, no timeout, worker not replaced)

Only clean results are kept: a timeout on a loaded machine or a dead worker says nothing
about the code, so the next identical call runs again. Code whose result depends on chance
or the clock gets the first draw for every copy of the same bytes; its expected reward is
unchanged. A workspace too large to digest cheaply (`max_files`, `max_bytes`) is not memoised.
Off by default (`SandboxConfig.memo_entries = 0`); the RL loop, evaluations and the study
turn it on.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import stat
import threading
from collections import OrderedDict
from typing import Any, Callable

MEMO_ENTRIES = 4096
"""Kept results when a caller turns memoisation on (each holds at most the truncated output)."""


def workspace_digest(root: str, max_files: int = 2000, max_bytes: int = 8 << 20) -> str | None:
    """sha256 over what `jail.copy_workspace` copies from `root`: the tree of non-link
    directories and regular files, each file's bytes and executable bits; None past
    `max_files` files or `max_bytes` bytes, or when anything cannot be read."""
    h, files, size = hashlib.sha256(), 0, 0
    try:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if not os.path.islink(os.path.join(dirpath, d)))
            rel = os.path.relpath(dirpath, root)
            h.update(b"D\0" + rel.encode("utf-8", "surrogateescape") + b"\0")
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    continue  # the copy skips links, devices and sockets too
                files, size = files + 1, size + st.st_size
                if files > max_files or size > max_bytes:
                    return None
                with open(path, "rb") as f:
                    data = f.read(max_bytes + 1)
                h.update(b"F\0" + name.encode("utf-8", "surrogateescape") + b"\0"
                         + bytes([st.st_mode & 0o111]) + len(data).to_bytes(8, "little") + data)
    except (OSError, ValueError):
        return None
    return h.hexdigest()


def _clean(result: Any) -> bool:
    return result.error is None and not result.timed_out and not result.replace_worker


class CallMemo:
    """Thread-safe LRU of clean sandbox results by request key, with in-flight sharing."""

    def __init__(self, max_entries: int = MEMO_ENTRIES):
        if max_entries < 1:
            raise ValueError(f"CallMemo needs max_entries >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._kept: OrderedDict[str, Any] = OrderedDict()
        self._running: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self.hits = self.runs = 0

    @staticmethod
    def key(workspace_dir: str, request: dict) -> str | None:
        """The request's key (`request` without the workspace path, which is replaced by the
        digest of its contents); None when the workspace cannot be digested."""
        digest = workspace_digest(str(workspace_dir))
        if digest is None:
            return None
        body = json.dumps({k: v for k, v in request.items() if k != "workspace"}, sort_keys=True, default=str)
        return hashlib.sha256(digest.encode() + b"\0" + body.encode()).hexdigest()

    def call(self, key: str | None, run: Callable[[], Any], wait_s: float) -> Any:
        """`run()`'s result, or a copy of the kept / in-flight one for the same `key`."""
        if key is None:
            return run()
        with self._lock:
            kept = self._lookup(key)
            if kept is None:
                event = self._running.get(key)
                owner = event is None
                if owner:
                    event = self._running[key] = threading.Event()
        if kept is not None:
            return kept
        if not owner:  # the same bytes are running now: share them
            event.wait(wait_s)
            with self._lock:
                kept = self._lookup(key)
            return kept if kept is not None else self.call(key, run, wait_s)
        try:
            result = run()
            with self._lock:
                self.runs += 1
                if _clean(result):
                    self._kept[key] = copy.deepcopy(result)
                    while len(self._kept) > self.max_entries:
                        self._kept.popitem(last=False)
            return result
        finally:
            with self._lock:
                self._running.pop(key, None)
            event.set()

    def _lookup(self, key: str) -> Any:
        """A copy of the kept result (and mark it recent); None if absent. Call with the lock."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        self._kept.move_to_end(key)
        self.hits += 1
        return copy.deepcopy(kept)
