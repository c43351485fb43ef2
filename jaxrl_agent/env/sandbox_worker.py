"""Sandbox pool worker: serves `Sandbox.run` requests in its own process (HOST).

See `jaxrl_agent.env.sandbox` for the isolation levels and what they cover. A worker is
spawned once (fresh interpreter, no JAX), builds its jail, pre-imports pytest, then for
each request copies the workspace, forks a child that enters the jail and runs the command,
drains its output under the wall timeout, and kills whatever the call left behind.
"""
from __future__ import annotations

import gc
import json
import os
import secrets
import select
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from jaxrl_agent.env import jail

if TYPE_CHECKING:  # the config lives in sandbox.py, which imports this module
    from jaxrl_agent.env.sandbox import SandboxConfig

REPORT_FD = 200  # where the child's pytest plugin writes its records


def _is_pytest(argv: list[str]) -> bool:
    """`python -m pytest ...` runs in the pre-warmed worker interpreter instead of exec."""
    exe = os.path.basename(argv[0]) if argv else ""
    return len(argv) >= 3 and (argv[0] == sys.executable or exe in ("python", "python3")) \
        and argv[1:3] == ["-m", "pytest"]



# The one schema of a report record (pytest_plugin._Reporter._emit): event -> field -> type.
# A record of any other shape is refused and counted as forged, so nothing downstream
# (summarize_tests, the verifier) ever meets a field of an unexpected type.
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

class _Worker:
    """State of one worker process (lives in the worker, not in the caller)."""

    def __init__(self, cfg: SandboxConfig, index: int):
        self.cfg = cfg
        self.is_root = os.geteuid() == 0
        self.uid = cfg.base_uid + index if self.is_root else None
        self.jail = None
        self.level = "basic"
        if self.is_root and cfg.isolation in ("auto", "namespaces"):
            try:
                self.jail = jail.build_jail(cfg.disk_mb, self.uid)
                self.level = "namespaces"
            except OSError as e:
                if cfg.isolation == "namespaces":
                    raise RuntimeError(f"sandbox: namespaces unavailable ({e})") from e
        if self.jail is None and self.is_root and cfg.isolation != "basic":
            # Without the jail the unprivileged uid sees the real filesystem: it must be able
            # to read the Python installation (not the case under a 0700 /root, e.g. pyenv).
            if jail.uid_can_read(self.uid, os.path.dirname(os.__file__)):
                self.level = "uid"
            elif cfg.isolation == "uid":
                raise RuntimeError("sandbox: isolation 'uid' needs the Python installation to "
                                   f"be readable by uid {self.uid}")
        if self.level == "basic":
            self.uid = None  # run as the caller's user
        if cfg.isolation in ("uid", "namespaces") and self.level != cfg.isolation:
            raise RuntimeError(f"sandbox: isolation {cfg.isolation!r} unavailable "
                               f"(got {self.level!r}; needs root)")
        self.scratch = tempfile.mkdtemp(prefix="jxa-sbx-")
        if self.jail is not None:
            self.workdir_host, self.workdir, self.tmp = (
                self.jail + "/workspace", "/workspace", self.jail + "/tmp")
        else:
            self.workdir_host = self.workdir = os.path.join(self.scratch, "workspace")
            self.tmp = os.path.join(self.scratch, "tmp")
            os.makedirs(self.workdir)
            os.makedirs(self.tmp, mode=0o1777)
            os.chmod(self.tmp, 0o1777)
            if self.uid is not None:
                os.chmod(self.scratch, 0o755)
                os.chown(self.workdir, self.uid, self.uid)
        if self.uid is not None:  # leftovers of a dead predecessor with the same uid
            jail.kill_uid(self.uid)
        from jaxrl_agent.env import pytest_plugin
        pytest_plugin.warm_up(self.scratch)
        # Everything imported so far is long-lived: keep it out of the children's garbage
        # collections (faster gc.collect, fewer copy-on-write page faults after fork).
        gc.collect()
        gc.freeze()

    # ---- one call ----

    def handle(self, req: dict) -> dict:
        t0 = time.perf_counter()
        argv, timeout = list(req["argv"]), float(req["timeout_s"])
        jail.clear_dir(self.workdir_host)
        jail.clear_dir(self.tmp)
        try:
            jail.copy_workspace(req["workspace"], self.workdir_host, self.uid)
            for rel in req.get("memory_files") or {}:  # placeholders; sources stay in memory
                path = os.path.join(self.workdir_host, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write("# test source provided in memory by the verifier\n")
        except (OSError, ValueError) as e:
            return dict(returncode=-1, stdout="", stderr="", error=f"workspace copy: {e}")
        nonce = secrets.token_hex(16)
        pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, report
        pid = os.fork()
        if pid == 0:
            self._child(argv, timeout, req, nonce, pipes)
        t_start = time.perf_counter()
        for _, w in pipes:
            os.close(w)
        bufs, timed_out, status = self._wait(pid, [r for r, _ in pipes], timeout)
        t_child = time.perf_counter() - t_start  # includes the sweep of leftover processes
        jail.reap_zombies()
        jail.clear_dir(self.workdir_host)
        jail.clear_dir(self.tmp)
        if os.WIFSIGNALED(status):
            rc = -os.WTERMSIG(status)
        else:
            rc = os.WEXITSTATUS(status)
        tests, forged = None, 0
        if _is_pytest(argv):
            tests = []
            for line in bufs[2].decode(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    rec = None
                if isinstance(rec, dict) and rec.pop("nonce", None) == nonce and well_formed(rec):
                    tests.append(rec)
                else:
                    forged += 1
        limit = self.cfg.max_output_bytes
        text = [_trunc(b, limit) for b in bufs[:2]]
        return dict(returncode=rc, stdout=text[0], stderr=text[1], timed_out=timed_out,
                    tests=tests, duration_s=t_child, forged_records=forged,
                    overhead_s=time.perf_counter() - t0 - t_child)

    def _child(self, argv, timeout, req, nonce, pipes) -> None:
        """Runs in the forked child; never returns."""
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(pipes[0][1], 1)
            os.dup2(pipes[1][1], 2)
            os.dup2(pipes[2][1], REPORT_FD)
            # Close every other descriptor: the worker's pipe to the caller among them.
            os.closerange(3, REPORT_FD)
            os.closerange(REPORT_FD + 1, 65536)
            cfg = self.cfg
            jail.enter_child(jail=self.jail, workdir=self.workdir, uid=self.uid,
                             cpu_s=int(timeout) + 1, memory_mb=cfg.memory_mb,
                             file_mb=cfg.file_mb, max_procs=cfg.max_procs,
                             max_files=cfg.max_open_files)
            tmp = "/tmp" if self.jail is not None else self.tmp
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp,
                   "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
                   "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
            os.environ.clear()
            os.environ.update(env)
            tempfile.tempdir = None
            if _is_pytest(argv):
                from jaxrl_agent.env import pytest_plugin
                sys.argv = ["pytest", *argv[3:]]
                sys.path.insert(0, os.getcwd())  # what `python -m` does
                sys.dont_write_bytecode = True
                rc = pytest_plugin.run_pytest(argv[3:], REPORT_FD, nonce,
                                              req.get("memory_files"), req.get("test_timeout_s"))
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
            exe = sys.executable if argv[0] in ("python", "python3") else argv[0]
            os.execvpe(exe, argv, env)
        except SystemExit as e:  # sys.exit from code run in-process
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            os._exit(code)
        except BaseException as e:  # noqa: BLE001 - report anything, then die
            try:
                os.write(2, f"sandbox: cannot start {argv[:1]}: {e!r}\n".encode())
            finally:
                os._exit(127)
        os._exit(127)

    def _wait(self, pid: int, fds: list[int], timeout: float):
        """Drain the child's pipes until it exits or the wall timeout; kill on timeout."""
        limit = self.cfg.max_output_bytes
        caps = [limit + 1, limit + 1, 4 << 20]  # keep a little more than shown to mark "..."
        bufs = [bytearray(), bytearray(), bytearray()]
        pidfd = os.pidfd_open(pid)
        deadline = time.monotonic() + timeout
        open_fds, timed_out, status = list(fds), False, None
        try:
            while status is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    _killpg(pid)
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
            # The child is gone; grandchildren may still hold the pipes: kill them first,
            # then read what is already buffered.
            _killpg(pid)
            if self.uid is not None:
                jail.kill_uid(self.uid)
            else:
                jail.kill_descendants()
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
        return bufs, timed_out, status


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _trunc(data: bytes, limit: int) -> str:
    if len(data) > limit:
        return data[:limit].decode(errors="replace") + "\n...[output truncated]"
    return data.decode(errors="replace")


def worker_main(conn, cfg: SandboxConfig, index: int) -> None:
    """Entry point of a pool worker: build the jail once, then serve requests forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the caller, not here
    try:
        # Orphans of calls re-parent here. (No PDEATHSIG on the worker: it would fire when
        # the caller *thread* that spawned it exits; EOF on the pipe ends the worker.)
        jail.prctl(jail.PR_SET_CHILD_SUBREAPER, 1)
        worker = _Worker(cfg, index)
    except BaseException as e:  # noqa: BLE001
        conn.send({"ready": False, "error": repr(e)})
        return
    conn.send({"ready": True, "isolation": worker.level,
               "dirs": [d for d in (worker.jail, worker.scratch) if d]})
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            return
        try:
            res = worker.handle(req)
        except Exception as e:  # noqa: BLE001 - a bug here must not kill the worker
            res = dict(returncode=-1, stdout="", stderr="", error=f"sandbox worker: {e!r}")
        res["isolation"] = worker.level
        conn.send(res)
