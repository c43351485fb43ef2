"""Process-isolated execution of untrusted code: the multiprocessing sandbox pool (HOST).

Threat model: the code the agent writes is hostile, and so is every byte it produces.
`Sandbox.run(workspace, argv)` runs `argv` on a private copy of `workspace`; `Sandbox.judge`
runs hidden tests in a judge process against that code (`judge.py`):

    caller thread --socket--> worker (started once from a minimal environment: no caller
                                 |    env vars; pytest pre-imported; root; never reads a
                                 |    request itself)
                                 |  per call: fork a manager (new IPC + PID namespace)
                                 v
                              manager: forks the child *before* reading the request, mounts
                                 |     the call's tmpfs, copies the workspace, runs / judges,
                                 |     kills everything, unmounts, answers
                                 v
                              child: own session, rlimits, chroot jail, per-worker uid;
                                     `python -m pytest ...` in-process (no interpreter
                                     start), the code server for a judge, else exec'd

Isolation levels (`Sandbox.isolation` says which one a pool got; chosen per worker):

"namespaces" (root with CAP_SYS_ADMIN, e.g. these machines and CI)
  - own network namespace: no network at all (only a private loopback);
  - own mount namespace + chroot into a jail: read-only bind mounts of the system library
    directories, the Python installation (also one under /tmp) and a few /etc files; the
    host's other files (home dirs, the repository, other episodes' workspaces, /proc) are
    absent. `/workspace` (the private copy) and `/tmp` are fresh tmpfs mounts per call,
    capped in size and inodes, lazily unmounted afterwards: nothing a call writes reaches
    the next one, and cleanup never walks the tree (deep, huge or unwritable);
  - a fresh IPC and PID namespace per call: SysV queues / shared memory die with the
    call, its processes see and signal only each other, and when the child (their init)
    exits the kernel kills the rest;
  - unprivileged uid/gid per worker, unique on the machine: RLIMIT_NPROC bounds fork bombs
    (root is exempt from it, hence the uid), the caller's workspace cannot be changed, the
    manager and judge (root, not dumpable) cannot be traced, read or signalled;
  - rlimits: CPU seconds, address space, file size, open files, core dumps off;
  - wall timeout kills the process group; afterwards every live process of the worker's
    uid (found in /proc) is SIGKILLed, repeatedly until none is left;
  - stdin is /dev/null; stdout/stderr are drained concurrently and truncated to
    `max_output_bytes`; all other descriptors are closed in the child.
"uid" (root, but namespaces refused, e.g. a container without CAP_SYS_ADMIN): as above
  without the network, IPC, PID and mount namespaces, the jail and the tmpfs caps: the
  child can read world-readable host files, reach the network and SysV IPC, and disk use
  is bounded only per file (RLIMIT_FSIZE). Chosen only if the unprivileged uid can read
  the Python installation.
"basic" (otherwise, e.g. not root): rlimits, private copy, and after each call every
  descendant of the manager is killed (it is a child subreaper). No uid drop, so no
  fork-bomb bound and no filesystem or network confinement; the judge is a process of the
  same user (not dumpable, so not traceable, but signallable). Development only.

At every level: the worker's memory never holds a request or a result (each call has its
own manager), so no call can read another's data, the hidden tests or the trainer's
environment from the memory it was forked from; the previous call's files are gone
before a call starts, or the worker is replaced (`RunResult.replace_worker`).

Not covered at any level: CPU/memory side channels, kernel exploits, denial of service
through the kernel, reading the Python installation or system libraries (needed to run).
Bubblewrap is not used: its primitives are applied here directly, because a bwrap exec per
call would need a fresh interpreter and lose the fork fast path.

A worker that dies (or stops answering) is killed and replaced; that call returns a
`RunResult` with `error` set. `run` never raises for anything the child does.
Linux only (pidfd_open needs kernel >= 5.3); the tmpfs caps of each worker count as RAM.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection

from jaxrl_agent.env.sandbox_memo import CallMemo

# ---- config and result ----


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandbox pool; `Sandbox(**fields)` accepts the same names."""

    num_workers: int = 2
    """Worker processes (concurrent calls)."""
    timeout_s: float = 10.0
    """Default wall-clock limit per call (the process group is killed after it)."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS) of the child, in MiB."""
    max_output_bytes: int = 16384
    """stdout and stderr are each truncated to this many bytes."""
    file_mb: int = 16
    """Largest file the child may write (RLIMIT_FSIZE), in MiB."""
    disk_mb: int = 64
    """Size of each of the call's tmpfs mounts (workspace, /tmp), in MiB ("namespaces" only)."""
    max_inodes: int = 20000
    """Files and directories each of the call's tmpfs mounts can hold ("namespaces" only)."""
    max_procs: int = 64
    """Processes/threads per worker uid (RLIMIT_NPROC; needs the uid drop)."""
    max_open_files: int = 256
    """RLIMIT_NOFILE of the child."""
    base_uid: int = 100000
    """Worker i of pool slot k runs untrusted code as uid/gid base_uid + k * 256 + i (root
    only). Slots are claimed with a lock file, so pools in different processes never share
    a uid (a pool's cleanup kills every process of its uids)."""
    isolation: str = "auto"
    """"auto" (best available), "namespaces", "uid" or "basic"; a forced level that the
    machine cannot provide makes the pool fail to start with a clear error."""
    memo_entries: int = 0
    """Identical calls (the same workspace bytes, command and limits) share one execution,
    up to this many clean results kept (`sandbox_memo.CallMemo`); 0: every call runs."""


@dataclass
class RunResult:
    """Outcome of one sandboxed call."""

    returncode: int
    """Exit status; negative: killed by that signal (-9 after a timeout)."""
    stdout: str
    stderr: str
    timed_out: bool = False
    error: str | None = None
    """Set when the sandbox itself failed (worker died, bad request); None otherwise."""
    tests: list[dict] | None = None
    """In-process pytest runs only: nonce-checked records, one per test outcome, plus the
    "start"/"end" session events (the end event lists tampered names)."""
    duration_s: float = 0.0
    """Wall time of the child."""
    isolation: str = ""
    """Isolation level of the worker that ran the call."""
    overhead_s: float = 0.0
    """Worker time spent outside the child (copy, fork, cleanup)."""
    forged_records: int = 0
    """Report lines without the call's nonce (evidence of a forging attempt)."""
    judge_calls: int = 0
    """`Sandbox.judge` only: calls the hidden tests made into the code under test."""
    replace_worker: bool = False
    """The worker could not clean up after this call and was replaced (the result stands)."""



# ---- the pool ----

_START_TIMEOUT_S = 120.0  # spawning a worker imports pytest and builds the jail
_GRACE_S = 30.0  # worker time beyond the call's timeout (copy, kill sweep, cleanup)


def _worker_env() -> dict[str, str]:
    """The whole environment a worker starts with: nothing of the caller's (tokens, keys)
    is in its memory, so nothing of it is in the memory its children are forked from."""
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
            "PYTHONPATH": os.pathsep.join(paths), "PYTHONDONTWRITEBYTECODE": "1",
            # the judge's pytest and the children's: no third-party plugins (entry points)
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


class _Handle:
    """Caller-side view of one worker process."""

    def __init__(self, cfg: SandboxConfig, index: int):
        self.index = index
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jaxrl_agent.env.sandbox_worker", str(theirs.fileno()),
                 json.dumps(dataclasses.asdict(cfg)), str(index)],
                pass_fds=[theirs.fileno()], env=_worker_env(), stdin=subprocess.DEVNULL,
                cwd="/")
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.info: dict = {}

    def wait_ready(self) -> None:
        if not self.conn.poll(_START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"sandbox worker {self.index} did not start")
        try:
            self.info = self.conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"sandbox worker {self.index} died while starting "
                               f"(exit status {self.proc.poll()})") from e
        if not self.info.get("ready"):
            self.kill()
            raise RuntimeError(f"sandbox worker {self.index} failed: {self.info.get('error')}")

    def kill(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for d in self.info.get("dirs", ()):  # host-side leftovers (jail mountpoint, scratch)
            shutil.rmtree(d, ignore_errors=True)


class Sandbox:
    """A pool of sandbox workers; use as a context manager.

    >>> with Sandbox(num_workers=2, timeout_s=5, memory_mb=512) as sb:
    ...     res = sb.run("/path/to/workspace", ["python", "-m", "pytest", "-q"])

    `run` is thread-safe: up to `num_workers` calls proceed in parallel, others wait for a
    free worker. Keyword arguments override fields of `config` (a `SandboxConfig`).
    """

    def __init__(self, num_workers: int | None = None, timeout_s: float | None = None,
                 memory_mb: int | None = None, *, config: SandboxConfig | None = None,
                 **overrides):
        known = {f.name for f in fields(SandboxConfig)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"Sandbox: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
        given = dict(num_workers=num_workers, timeout_s=timeout_s, memory_mb=memory_mb, **overrides)
        cfg = dataclasses.replace(config or SandboxConfig(),
                                  **{k: v for k, v in given.items() if v is not None})
        if not 1 <= cfg.num_workers <= _SLOT or cfg.timeout_s <= 0 or cfg.memory_mb < 64:
            raise ValueError(f"Sandbox: need 1 <= num_workers <= {_SLOT}, timeout_s > 0, "
                             "memory_mb >= 64")
        if cfg.isolation not in ("auto", "namespaces", "uid", "basic"):
            raise ValueError(f"Sandbox: unknown isolation {cfg.isolation!r}")
        if cfg.memo_entries < 0:
            raise ValueError(f"Sandbox: memo_entries must be >= 0 (0: off), got {cfg.memo_entries}")
        self.memo = CallMemo(cfg.memo_entries) if cfg.memo_entries else None
        self._slot_lock = None
        if os.geteuid() == 0:
            slot, self._slot_lock = _claim_slot()
            cfg = dataclasses.replace(cfg, base_uid=cfg.base_uid + slot * _SLOT)
        self.config = cfg
        self._idle: queue.Queue[_Handle] = queue.Queue()
        self._all: dict[int, _Handle] = {}
        self._lock = threading.Lock()
        self._closed = False
        handles = [_Handle(cfg, i) for i in range(cfg.num_workers)]
        try:
            for h in handles:
                h.wait_ready()
        except BaseException:
            for h in handles:
                h.kill()
            raise
        for h in handles:
            self._all[h.index] = h
            self._idle.put(h)
        self.isolation = min((h.info["isolation"] for h in handles), key=_LEVELS.index)
        self.restarts = 0
        self._finalizer = weakref.finalize(self, _kill_all, list(handles))

    # ---- public API ----

    def run(self, workspace_dir: str | os.PathLike, argv: list[str],
            timeout_s: float | None = None, *, memory_files: dict[str, str] | None = None,
            test_timeout_s: float | None = None) -> RunResult:
        """Run `argv` on a private copy of `workspace_dir`; never raises for the child.

        Args:
          workspace_dir: directory copied (regular files only) into the child's workspace.
          argv: command; `["python", "-m", "pytest", ...]` runs in the warm worker.
          timeout_s: wall-clock limit (default: the pool's `timeout_s`).
          memory_files: relative path -> test source, collected by pytest from memory (the
            file on disk is a placeholder), so the code under test cannot read them.
          test_timeout_s: per-test CPU-time limit for in-process pytest runs (SIGPROF).
        """
        bad = self._check_request(workspace_dir, argv, timeout_s, memory_files)
        if bad:
            return RunResult(-1, "", "", error=bad, isolation=self.isolation)
        timeout = float(timeout_s or self.config.timeout_s)
        req = dict(workspace=os.path.abspath(workspace_dir), argv=[str(a) for a in argv],
                   timeout_s=timeout, memory_files=dict(memory_files or {}),
                   test_timeout_s=test_timeout_s)
        return self._request(req, timeout)

    def judge(self, workspace_dir: str | os.PathLike, pytest_args: list[str],
              test_sources: dict[str, str], modules: list[str], timeout_s: float | None = None,
              *, test_timeout_s: float = 1.0, call_wall_s: float | None = None) -> RunResult:
        """Run hidden tests in a judge process against the code of `workspace_dir`.

        The tests (`test_sources`: relative path -> source, collected from memory) run
        under pytest in the call's manager process; every import of a name in `modules`
        (the task's source modules, e.g. "bsearch", "pkg.mod") is a proxy that forwards
        calls as plain data to a jailed child serving the workspace's code
        (`judge.py`, `code_server.py`). The child never holds a test, an expected value
        or the report. `test_timeout_s` is each call's CPU limit in the child;
        `call_wall_s` (default 3x that + 1 s) the wall time the judge waits for an answer.
        """
        bad = self._check_request(workspace_dir, ["python"], timeout_s, test_sources)
        if bad:
            return RunResult(-1, "", "", error=bad, isolation=self.isolation)
        timeout = float(timeout_s or self.config.timeout_s)
        wall = float(call_wall_s or 3.0 * test_timeout_s + 1.0)
        req = dict(workspace=os.path.abspath(workspace_dir),
                   argv=[sys.executable, "-m", "pytest", *map(str, pytest_args)],
                   timeout_s=timeout, memory_files=dict(test_sources),
                   test_timeout_s=test_timeout_s,
                   judge={"modules": sorted(modules), "call_wall_s": wall})
        return self._request(req, timeout)

    def _request(self, req: dict, timeout: float) -> RunResult:
        """One call, or a copy of an identical one's result (`memo_entries`)."""
        if self.memo is None:
            return self._call(req, timeout)
        return self.memo.call(CallMemo.key(req["workspace"], req), lambda: self._call(req, timeout),
                              wait_s=timeout + _GRACE_S)

    def _call(self, req: dict, timeout: float) -> RunResult:
        handle = self._idle.get()
        try:
            if self._closed:
                return RunResult(-1, "", "", error="sandbox is closed", isolation=self.isolation)
            try:
                handle.conn.send(req)
                if handle.conn.poll(timeout + _GRACE_S):
                    res = RunResult(**handle.conn.recv())
                    if res.replace_worker:  # it could not clean up: a fresh one for the next call
                        handle = self._replace(handle)
                    return res
                why = "sandbox worker stopped answering; replaced"
            except (EOFError, OSError) as e:
                why = f"sandbox worker died ({type(e).__name__}); replaced"
            handle = self._replace(handle)
            return RunResult(-1, "", "", error=why, isolation=self.isolation)
        finally:
            self._idle.put(handle)

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _kill_all(list(self._all.values()))
        if self._slot_lock is not None:
            self._slot_lock.close()  # releases the uid slot

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for tests and monitoring)."""
        return [h.proc.pid for h in self._all.values()]

    # ---- internals ----

    def _replace(self, handle: _Handle) -> _Handle:
        handle.kill()
        new = _Handle(self.config, handle.index)
        try:
            new.wait_ready()
        except RuntimeError:
            new.kill()
            new = _Handle(self.config, handle.index)  # one more try, then give up
            new.wait_ready()
        with self._lock:
            self._all[handle.index] = new
            self.restarts += 1
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _kill_all, list(self._all.values()))
        return new

    @staticmethod
    def _check_request(workspace_dir, argv, timeout_s, memory_files) -> str | None:
        if not isinstance(argv, (list, tuple)) or not argv or \
                not all(isinstance(a, (str, os.PathLike)) for a in argv):
            return f"argv must be a non-empty list of strings, got {argv!r:.200}"
        if not os.path.isdir(workspace_dir):
            return f"workspace_dir {str(workspace_dir)!r} is not a directory"
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            return f"timeout_s must be a positive number, got {timeout_s!r}"
        for rel in memory_files or {}:
            if os.path.isabs(rel) or ".." in rel.split("/"):
                return f"memory_files path {rel!r} must be relative, without '..'"
        return None


_LEVELS = ["basic", "uid", "namespaces"]
_SLOT = 256  # uids per pool slot (and the largest pool)
_SLOT_DIR = "/tmp/jxa-sandbox-uid-slots"


def _claim_slot(max_slots: int = 1024):
    """Lock the first free uid slot; the open file holds the lock for the pool's lifetime
    (the kernel drops it if the process dies)."""
    os.makedirs(_SLOT_DIR, mode=0o700, exist_ok=True)
    for slot in range(max_slots):
        f = open(os.path.join(_SLOT_DIR, f"{slot}.lock"), "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return slot, f
        except OSError:
            f.close()
    raise RuntimeError(f"sandbox: all {max_slots} uid slots are in use")


def _kill_all(handles: list[_Handle]) -> None:
    for h in handles:
        h.kill()
