"""Sandbox pool worker: serves `Sandbox.run` / `Sandbox.judge` requests (HOST).

See `jaxrl_agent.env.sandbox` for the isolation levels and what they cover. A worker is
started once from a minimal environment (`python -m jaxrl_agent.env.sandbox_worker`, no JAX,
nothing of the caller's in its memory), builds its jail and pre-imports pytest. It never
reads a request itself: each call gets a fresh *manager* process, so no call's data (the
hidden tests, a previous result) is ever in the memory the next call's child is forked from:

    worker (clean) --fork per call--> manager: new IPC + PID namespace (made ahead of time)
                                        |-- fork (before the request is read) --> child
                                        |   (clean copy; waits for its instructions)
                                        |-- recv request, mount the call's tmpfs, copy
                                        |   the workspace, send the child its argv
                                        |-- run: drain the child's output (wall timeout)
                                        |   judge: run the hidden tests here (judge.py),
                                        |   the child serves calls (code_server.py)
                                        '-- kill everything, unmount, send the result

The child enters the jail, drops to the worker's uid and runs the command: `python -m pytest`
in-process (no interpreter start), anything else exec'd, or the code server. A manager that
cannot clean up asks for its worker to be replaced (`replace_worker` in the result).
"""
from __future__ import annotations

import gc
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from types import SimpleNamespace

from jaxrl_agent.env import code_server, jail, judge
from jaxrl_agent.env.sandbox_io import drain, killpg, parse_records

REPORT_FD = 200  # where an in-process pytest run (child or judge) writes its records
REQ_FD = 201  # judge -> code server requests, in the child
_EOF, _REPLACE = 5, 6  # manager exit codes: the caller is gone / replace this worker
_CHILD_ENV = {"PATH": os.path.dirname(sys.executable) + ":/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
              "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def _is_pytest(argv: list[str]) -> bool:
    """`python -m pytest ...` runs in the pre-warmed worker interpreter instead of exec."""
    exe = os.path.basename(argv[0]) if argv else ""
    return len(argv) >= 3 and (argv[0] == sys.executable or exe in ("python", "python3")) \
        and argv[1:3] == ["-m", "pytest"]


class _Worker:
    """State of one worker process (lives in the worker, not in the caller)."""

    def __init__(self, cfg, index: int):
        self.cfg = cfg
        self.is_root = os.geteuid() == 0
        self.uid = cfg.base_uid + index if self.is_root else None
        self.jail = None
        self.level = "basic"
        if self.is_root and cfg.isolation in ("auto", "namespaces"):
            try:
                self.jail = jail.build_jail(cfg.disk_mb, self.uid)
                jail.mount_call_dirs(self.jail, 1, self.uid, 64)  # probe the per-call mounts
                jail.release_call_dirs(self.jail)
                _probe_call_namespaces()
                self.level = "namespaces"
            except OSError as e:
                if cfg.isolation == "namespaces":
                    raise RuntimeError(f"sandbox: namespaces unavailable ({e})") from e
                self.jail = None
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
        self.scratch = tempfile.mkdtemp(prefix="jxa-sbx-")  # 0700: the child cannot enter
        self.judge_dir = os.path.join(self.scratch, "judge")
        os.makedirs(self.judge_dir)
        if self.jail is not None:
            self.workdir_host, self.workdir, self.tmp = (
                self.jail + "/workspace", "/workspace", self.jail + "/tmp")
        else:
            self.outer = os.path.join(self.scratch, "call")  # world-traversable, judge_dir not
            self.workdir_host = self.workdir = os.path.join(self.outer, "workspace")
            self.tmp = os.path.join(self.outer, "tmp")
            os.makedirs(self.workdir)
            os.makedirs(self.tmp, mode=0o1777)
            os.chmod(self.tmp, 0o1777)
            if self.uid is not None:
                os.chmod(self.scratch, 0o711)
                os.chmod(self.outer, 0o755)
                os.chown(self.workdir, self.uid, self.uid)
        if self.uid is not None:  # leftovers of a dead predecessor with the same uid
            jail.kill_uid(self.uid)
        from jaxrl_agent.env import pytest_plugin
        pytest_plugin.warm_up(self.scratch)
        # Everything imported so far is long-lived: keep it out of the children's garbage
        # collections (faster gc.collect, fewer copy-on-write page faults after fork).
        gc.collect()
        gc.freeze()

    # ---- the worker's loop: one manager process per call ----

    def serve(self, conn) -> None:
        while True:
            # The next call's manager (and its child) are made at once, before any request
            # is waiting: namespaces and forks cost the caller nothing while the pool idles.
            worker = os.getpid()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = self._manage(conn, worker)
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
            if code in (_EOF, _REPLACE):
                return
            if code != 0:  # the manager died before answering: answer, then be replaced
                try:
                    conn.send(dict(returncode=-1, stdout="", stderr="", isolation=self.level,
                                   error=f"sandbox call manager died (status {code}); replaced",
                                   replace_worker=True))
                except OSError:
                    pass
                return

    # ---- one call (in the manager process) ----

    def _manage(self, conn, worker: int) -> int:
        if self.jail is not None:
            jail.unshare_call()
        jail.prctl(jail.PR_SET_CHILD_SUBREAPER, 1)  # orphans of the call re-parent here
        jail.prctl(jail.PR_SET_PDEATHSIG, signal.SIGKILL)  # the worker's death ends the call
        if os.getppid() != worker:  # it died before PDEATHSIG was set: no signal will come
            return _EOF
        instr_r, instr_w = os.pipe()
        io = [os.pipe() for _ in range(4)]  # child stdout, stderr, judge->child, child->judge
        pid = os.fork()
        if pid == 0:  # forked before the request is read: nothing of it is in this memory
            os.close(instr_w)
            self._child(instr_r, io)
        os.close(instr_r)
        for fd in (io[0][1], io[1][1], io[2][0], io[3][1]):
            os.close(fd)
        try:
            req = conn.recv()
        except (EOFError, OSError):
            self._kill_call(pid)
            return _EOF
        try:
            res = self._handle(req, pid, instr_w, io)
        except Exception as e:  # noqa: BLE001 - a bug here must not lose the answer
            res = dict(returncode=-1, stdout="", stderr="", error=f"sandbox worker: {e!r}")
        self._kill_call(pid)
        clean = self._release()
        res["isolation"] = self.level
        if not clean:
            res["replace_worker"] = True
        conn.send(res)
        return 0 if clean else _REPLACE

    def _prepare(self) -> None:
        if self.jail is not None:
            jail.mount_call_dirs(self.jail, self.cfg.disk_mb, self.uid, self.cfg.max_inodes)
        elif not (jail.clear_dir(self.workdir_host) and jail.clear_dir(self.tmp)):
            raise OSError("the previous call's files could not be removed")

    def _release(self) -> bool:
        if self.jail is not None:
            return jail.release_call_dirs(self.jail)
        return jail.clear_dir(self.workdir_host) and jail.clear_dir(self.tmp)

    def _kill_call(self, pid: int) -> None:
        killpg(pid)
        if self.uid is not None:
            jail.kill_uid(self.uid)
        else:
            jail.kill_descendants()

    def _handle(self, req: dict, pid: int, instr_w: int, io) -> dict:
        t0 = time.perf_counter()
        argv, timeout = list(req["argv"]), float(req["timeout_s"])
        judged = req.get("judge")
        try:
            self._prepare()
            jail.copy_workspace(req["workspace"], self.workdir_host, self.uid)
            if not judged:
                for rel in req.get("memory_files") or {}:  # placeholders; sources in memory
                    path = os.path.join(self.workdir_host, rel)
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path, "w") as f:
                        f.write("# test source provided in memory by the verifier\n")
        except (OSError, ValueError) as e:
            os.close(instr_w)
            return dict(returncode=-1, stdout="", stderr="", error=f"workspace copy: {e}")
        nonce = secrets.token_hex(16)
        if judged:  # the child learns the module names and its CPU limit per call, no more
            instr = dict(argv=argv, timeout=timeout, serve=judged["modules"],
                         call_cpu_s=req.get("test_timeout_s"))
        else:
            instr = dict(argv=argv, timeout=timeout, nonce=nonce,
                         memory_files=req.get("memory_files") or {},
                         test_timeout_s=req.get("test_timeout_s"))
        try:
            code_server.write_all(instr_w, json.dumps(instr).encode())
        except OSError:
            pass
        os.close(instr_w)
        t_start = time.perf_counter()
        if judged:
            out = self._judge(req, judged, pid, io, timeout, nonce)
        else:
            os.close(io[2][1])
            fds = [io[0][0], io[1][0], io[3][0]]
            bufs, timed_out, status = drain(pid, fds, timeout, self.cfg.max_output_bytes,
                                            on_exit=lambda: self._kill_call(pid))
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            out = dict(returncode=rc, stdout=bufs[0], stderr=bufs[1], timed_out=timed_out)
            if _is_pytest(argv):
                out["tests"], out["forged_records"] = parse_records(bufs[2], nonce)
        t_child = time.perf_counter() - t_start  # includes the sweep of leftover processes
        jail.reap_zombies()
        limit = self.cfg.max_output_bytes
        out["stdout"], out["stderr"] = _trunc(out["stdout"], limit), _trunc(out["stderr"], limit)
        return dict(out, duration_s=t_child, overhead_s=time.perf_counter() - t0 - t_child)

    def _judge(self, req: dict, judged: dict, pid: int, io, timeout: float, nonce: str) -> dict:
        """Run the hidden tests in this process against the child's code server."""
        limit = self.cfg.max_output_bytes
        # Placeholders for the test paths in a directory the child cannot see.
        tests = dict(req.get("memory_files") or {})
        jail.clear_dir(self.judge_dir)
        for rel in tests:
            path = os.path.join(self.judge_dir, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write("# test source provided in memory by the verifier\n")
        report = os.open(os.path.join(self.scratch, "report"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        log = os.open(os.path.join(self.scratch, "judge.log"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(report, REPORT_FD)
        os.dup2(log, 1)
        os.dup2(log, 2)
        deadline = time.monotonic() + timeout
        channel = judge.Channel(io[2][1], io[3][0], float(judged.get("call_wall_s") or 5.0),
                                deadline, on_dead=lambda: self._kill_call(pid),
                                sinks=[io[0][0], io[1][0]], cap=limit + 1)
        judge.install(channel, list(judged["modules"]))
        os.chdir(self.judge_dir)
        sys.path[:] = [p for p in sys.path if p not in ("", ".")]
        jail.prctl(jail.PR_SET_DUMPABLE, 0)  # no ptrace, no /proc/<pid>/mem of the judge
        from jaxrl_agent.env import pytest_plugin
        try:
            rc = pytest_plugin.run_pytest(argv_tail(req["argv"]), REPORT_FD, nonce, tests, None)
        except BaseException as e:  # noqa: BLE001 - a broken hidden test module, SystemExit
            os.write(2, f"judge: {e!r}\n".encode())
            rc = 3
        sys.stdout.flush()
        sys.stderr.flush()
        self._kill_call(pid)
        os.close(io[2][1])
        bufs = channel.finish()
        for fd in (io[0][0], io[1][0], io[3][0]):
            os.close(fd)
        os.lseek(report, 0, 0)
        os.lseek(log, 0, 0)
        records, forged = parse_records(_read_all(report), nonce)
        judge_out = _read_all(log, limit + 1)
        return dict(returncode=rc, stdout=judge_out + bufs[0], stderr=bufs[1], tests=records,
                    forged_records=forged, timed_out=channel.timed_out,
                    judge_calls=channel.calls)

    def _child(self, instr_r: int, io) -> None:
        """Runs in the forked child; never returns."""
        try:
            os.setsid()
            chunks = []
            while chunk := os.read(instr_r, 1 << 16):
                chunks.append(chunk)
            os.close(instr_r)
            if not chunks:
                os._exit(0)
            instr = json.loads(b"".join(chunks))
            argv, timeout = instr["argv"], instr["timeout"]
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(io[0][1], 1)
            os.dup2(io[1][1], 2)
            os.dup2(io[3][1], REPORT_FD)  # records (pytest) or replies (code server)
            os.dup2(io[2][0], REQ_FD)
            # Close every other descriptor: the manager's pipe to the caller among them.
            os.closerange(3, REPORT_FD)
            os.closerange(REQ_FD + 1, 65536)
            cfg = self.cfg
            jail.enter_child(jail=self.jail, workdir=self.workdir, uid=self.uid,
                             cpu_s=int(timeout) + 1, memory_mb=cfg.memory_mb,
                             file_mb=cfg.file_mb, max_procs=cfg.max_procs,
                             max_files=cfg.max_open_files)
            tmp = "/tmp" if self.jail is not None else self.tmp
            env = dict(_CHILD_ENV, HOME=tmp, TMPDIR=tmp)
            os.environ.clear()
            os.environ.update(env)
            tempfile.tempdir = None
            if "serve" in instr:
                sys.path.insert(0, os.getcwd())
                sys.dont_write_bytecode = True
                os.close(0)
                rc = code_server.serve(REQ_FD, REPORT_FD, instr["serve"], instr.get("call_cpu_s"))
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
            os.close(REQ_FD)
            if _is_pytest(argv):
                from jaxrl_agent.env import pytest_plugin
                sys.argv = ["pytest", *argv[3:]]
                sys.path.insert(0, os.getcwd())  # what `python -m` does
                sys.dont_write_bytecode = True
                rc = pytest_plugin.run_pytest(argv[3:], REPORT_FD, instr["nonce"],
                                              instr.get("memory_files"), instr.get("test_timeout_s"))
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
            os.close(REPORT_FD)
            exe = sys.executable if argv[0] in ("python", "python3") else argv[0]
            os.execvpe(exe, argv, env)
        except SystemExit as e:  # sys.exit from code run in-process
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            os._exit(code)
        except BaseException as e:  # noqa: BLE001 - report anything, then die
            try:
                os.write(2, f"sandbox: cannot start the command: {e!r}\n".encode())
            finally:
                os._exit(127)
        os._exit(127)


def _probe_call_namespaces() -> None:
    """Raise OSError unless a forked process can make the per-call IPC + PID namespaces."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            jail.unshare_call()
            inner = os.fork()
            if inner == 0:
                os._exit(0)
            os.waitpid(inner, 0)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        raise OSError("unshare(ipc+pid) refused")


def argv_tail(argv: list[str]) -> list[str]:
    """pytest's own arguments of a `python -m pytest ...` command."""
    return list(argv[3:]) if _is_pytest(argv) else list(argv)


def _read_all(fd: int, limit: int = 4 << 20) -> bytes:
    out = bytearray()
    while len(out) < limit and (chunk := os.read(fd, 1 << 16)):
        out += chunk
    return bytes(out[:limit])


def _trunc(data: bytes, limit: int) -> str:
    if len(data) > limit:
        return data[:limit].decode(errors="replace") + "\n...[output truncated]"
    return data.decode(errors="replace")


def main(argv: list[str]) -> None:
    """`python -m jaxrl_agent.env.sandbox_worker FD CONFIG_JSON INDEX`: build the jail once,
    then serve requests on the socket FD until it closes."""
    from multiprocessing.connection import Connection
    conn = Connection(int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the caller, not here
    try:
        # If the caller dies the socket closes and the loop ends (no PDEATHSIG: it would
        # fire when the caller *thread* that started the worker exits).
        worker = _Worker(SimpleNamespace(**json.loads(argv[1])), int(argv[2]))
    except BaseException as e:  # noqa: BLE001
        conn.send({"ready": False, "error": repr(e)})
        return
    conn.send({"ready": True, "isolation": worker.level,
               "dirs": [d for d in (worker.jail, worker.scratch) if d]})
    worker.serve(conn)


if __name__ == "__main__":
    main(sys.argv[1:])
