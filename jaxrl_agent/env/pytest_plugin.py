"""In-process pytest runner for sandbox calls (HOST; in the child, or in the judge process).

A sandbox worker has already imported pytest; for `python -m pytest ...` it forks a child
that calls `run_pytest` instead of starting a new interpreter (that is where the pool's speed
comes from). The plugin here adds what a plain pytest run cannot give a judge:

- per-test outcome records written to a private pipe, each tagged with a per-call nonce, so
  text the untrusted code prints (or writes to a guessed fd) cannot forge a result;
- a tamper check: the identities of the callables in `builtins`, `pytest`/`_pytest`,
  `pluggy`, `unittest` and this package (module and class attributes) are snapshotted
  before collection imports any agent code and compared at the end of the session; the
  functions of in-memory test modules must still run their original code objects;
- the pid of the writer in every record, so a forked copy of the session is visible;
- optional per-test CPU-time limits (SIGPROF), so one looping test fails alone with a clear message;
- in-memory test modules: files named in `memory_files` are compiled from sources held in
  memory (the copies on disk are placeholders), so code under test cannot read them from disk.

Where it runs: in the sandboxed child for `Sandbox.run` (the agent's own `run_tests`: an
observation, not a verdict; code that introspects the interpreter can reach the nonce
there), and in the judge process for `Sandbox.judge` (`verify`), where the code under test
is another process that only answers plain-data calls (`judge.py`), so nothing here is
within its reach.
"""
from __future__ import annotations

import ast
import builtins
import json
import os
import signal
import sys
import types

import pytest

# ---- records ----


def _short(text: str, limit: int = 600) -> str:
    """Trim a failure text to its most useful tail (the assertion and the line)."""
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def _failure_text(report) -> str:
    """One compact failure message: the crash line and the failing source lines."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return _short(str(crash.message))
    return _short(str(getattr(report, "longrepr", "") or ""))


# ---- tamper snapshot ----

_WATCHED_PREFIXES = ("pytest", "_pytest", "pluggy", "unittest", "jaxrl_agent")


def _snapshot() -> dict[str, int]:
    """Identity of every callable/class attribute in the modules a cheat would patch."""
    snap: dict[str, int] = {}
    mods = [("builtins", builtins)] + [
        (name, mod) for name, mod in list(sys.modules.items())
        if isinstance(mod, types.ModuleType) and name.split(".")[0] in _WATCHED_PREFIXES
    ]
    for mname, mod in mods:
        for attr, val in list(vars(mod).items()):
            if callable(val):
                snap[f"{mname}.{attr}"] = id(val)
            if isinstance(val, type) and getattr(val, "__module__", "") == mname:
                for cattr, cval in list(vars(val).items()):
                    snap[f"{mname}.{attr}.{cattr}"] = id(cval)
    return snap


# Taken once in the worker after `warm_up` (the state every forked child starts from), so a
# child only pays for the snapshot after its session.
_BASELINE: dict[str, int] | None = None


def _diff(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """Keys whose object changed or vanished (new modules imported later are ignored)."""
    return sorted(k for k, v in before.items() if after.get(k) != v)


# ---- in-memory test modules ----


class MemoryModule(pytest.Module):
    """A test module whose source comes from memory, not from the (placeholder) file."""

    source: str = ""
    reporter = None  # the _Reporter that checks this module's functions at the end

    def _getobj(self):
        name = self.path.stem
        # A filename that is not a real path: tracebacks then never show the placeholder
        # file's lines against the in-memory line numbers.
        filename = f"<memory>/{self.path.name}"
        tree = ast.parse(self.source, filename=filename)
        try:  # assertion rewriting gives the same rich messages as a file on disk
            from _pytest.assertion.rewrite import rewrite_asserts
            rewrite_asserts(tree, self.source.encode(), filename, self.config)
        except Exception:  # pragma: no cover - rewriting is a nicety, not a requirement
            tree = ast.parse(self.source, filename=filename)
        code = compile(tree, filename, "exec", dont_inherit=True)
        mod = types.ModuleType(name)
        mod.__file__ = str(self.path)
        sys.modules[name] = mod
        # The code objects of the module's own top-level functions, taken from the compiled
        # code (not from the module dict, which the code under test could already reach).
        originals = {c.co_name: c for c in code.co_consts
                     if isinstance(c, types.CodeType) and c.co_name.isidentifier()}
        exec(code, mod.__dict__)
        if self.reporter is not None:  # only fully imported modules are checked at the end
            # Watch the names bound to plain functions now, plus names bound to something
            # that is neither a function nor an object with attributes (a constant, a
            # builtin): those were rebound already. Classes and fixture objects are skipped.
            watched = {n: c for n, c in originals.items()
                       if isinstance(vars(mod).get(n), types.FunctionType)
                       or not hasattr(vars(mod).get(n), "__dict__")}
            self.reporter.watch_module(mod, watched)
        return mod


# ---- the plugin ----


class _Reporter:
    """pytest plugin: nonce-tagged outcome records, tamper check, per-test timeout."""

    def __init__(self, fd: int, nonce: str, memory_files: dict[str, str],
                 test_timeout_s: float | None):
        # Bind what we use now: later monkeypatching of os/json by agent code cannot
        # redirect these references.
        self._write, self._dumps, self._fd, self._nonce = os.write, json.dumps, fd, nonce
        self._getpid = os.getpid
        self._memory = dict(memory_files)
        self._timeout = test_timeout_s
        # Copied now, before any agent code runs (it could otherwise empty the shared dict).
        self._before: dict[str, int] = dict(_BASELINE) if _BASELINE is not None else {}
        self._modules: list[tuple[types.ModuleType, dict]] = []

    def watch_module(self, mod: types.ModuleType, originals: dict) -> None:
        self._modules.append((mod, originals))

    def _module_tampering(self) -> list[str]:
        """In-memory test modules whose own functions were replaced (e.g. a helper
        patched to always return True by the code under test)."""
        bad = []
        for mod, originals in self._modules:
            for name, code in originals.items():
                obj = vars(mod).get(name)
                if getattr(obj, "__code__", None) is not code:
                    bad.append(f"{mod.__name__}.{name}")
        return bad

    def _emit(self, **rec) -> None:
        rec["nonce"] = self._nonce
        rec["pid"] = self._getpid()  # a forked copy of the session shows up as another pid
        try:
            self._write(self._fd, (self._dumps(rec) + "\n").encode())
        except OSError:
            pass

    def pytest_sessionstart(self, session):
        if not self._before:
            self._before = _snapshot()
        self._emit(event="start")

    def pytest_pycollect_makemodule(self, module_path, parent):
        rel = os.path.relpath(str(module_path), str(parent.config.rootpath))
        if rel in self._memory:
            mod = MemoryModule.from_parent(parent, path=module_path)
            mod.source = self._memory[rel]
            mod.reporter = self
            return mod
        return None

    def pytest_collectreport(self, report):
        if report.failed:
            self._emit(event="test", id=report.nodeid or "<collection>", when="collect",
                       outcome="error", message=_failure_text(report))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        if not self._timeout:
            yield
            return
        timeout = self._timeout

        def _alarm(signum, frame):
            raise TimeoutError(f"test timed out after {timeout:g}s (infinite loop?)")

        # CPU time (ITIMER_PROF), not wall time: a loop burns CPU, while a loaded machine
        # only delays a correct test; sleeping code is left to the sandbox's wall timeout.
        old = signal.signal(signal.SIGPROF, _alarm)
        signal.setitimer(signal.ITIMER_PROF, timeout)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.signal(signal.SIGPROF, old)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            outcome = report.outcome if report.when == "call" else (
                "skipped" if report.skipped else "error")
            self._emit(event="test", id=report.nodeid, when=report.when, outcome=outcome,
                       message="" if report.passed else _failure_text(report))

    def pytest_sessionfinish(self, session, exitstatus):
        tampered = _diff(self._before, _snapshot()) + self._module_tampering()
        self._emit(event="end", exitstatus=int(exitstatus), tampered=tampered[:10])


_DISABLED = ("cacheprovider", "unraisableexception", "threadexception", "doctest", "junitxml",
             "pastebin", "legacypath", "stepwise", "setuponly", "setupplan", "faulthandler",
             "debugging")


def run_pytest(args: list[str], report_fd: int, nonce: str,
               memory_files: dict[str, str] | None = None,
               test_timeout_s: float | None = None) -> int:
    """Run pytest in this (already sandboxed) process; returns its exit code."""
    plugin = _Reporter(report_fd, nonce, memory_files or {}, test_timeout_s)
    # No cache dir: the run depends only on argv and the files. The unraisable/thread
    # exception plugins call gc.collect() five times per session (tens of ms); the others
    # serve features a test run here never uses (reports, pdb, doctests, step-wise).
    args = [a for p in _DISABLED for a in ("-p", "no:" + p)] + list(args)
    return int(pytest.main(args, plugins=[plugin]))


def warm_up(tmpdir: str) -> None:
    """Import everything a pytest session imports lazily, in the worker, before forking.

    Runs one trivial session on a test file written here (trusted content), so each forked
    child starts with a warm module cache instead of re-importing pytest's plugins.
    """
    path = os.path.join(tmpdir, "test_jxa_warmup.py")
    with open(path, "w") as f:
        # A passing and a failing test: failure reports warm inspect's module caches too.
        f.write("def test_warm():\n    assert [1] == [1]\n\n"
                "def test_warm_fail():\n    assert [1] == [2]\n")
    saved_path, saved_mods = list(sys.path), set(sys.modules)
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved_fds = os.dup(1), os.dup(2)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        run_pytest(["-q", "--rootdir", tmpdir, path], devnull, "warm",
                   test_timeout_s=5.0)
    except BaseException:  # a failed warm-up only costs speed
        pass
    finally:
        sys.stdout.flush()  # into /dev/null, not into the first call's output
        sys.stderr.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in (*saved_fds, devnull):
            os.close(fd)
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_mods:
            if name.startswith("test_jxa_warmup"):
                del sys.modules[name]
    global _BASELINE
    _BASELINE = _snapshot()
