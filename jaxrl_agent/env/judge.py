"""The judge side of a `verify`: hidden tests that reach the code under test only as data (HOST).

Runs in the sandbox's per-call manager process, which the untrusted child cannot read,
signal or share memory with (another uid, another PID and IPC namespace, not dumpable).
The hidden tests run here under pytest, exactly as written; every import of a task module
(`from bsearch import binary_search`) gets a *proxy module* instead of the agent's code:

    hidden test --> proxy.binary_search(xs, 3) --JSON line--> child (code_server.serve)
        _same(result, 2) <-- decode(tree): plain data only <--

so every comparison, every expected value, the tests' source and the report stay in this
process. What the child sends is parsed by `code_server.decode`, which builds only plain
types; an exception it reports is re-raised here as the builtin of that name (or
`RemoteError`); a reply that is malformed, too large, or does not come within the call's
wall limit fails the test (`NoAnswer`), and after a missed reply the child is killed and
every later call fails at once.

Supported in users' hidden tests: calling functions and classes of the task's modules with
plain-data arguments, reading module attributes that are plain data, and methods and
attributes of the instances such calls return (handles; a handle is never equal to
anything, has no truth value and cannot be hashed by value). Not supported: anything that
needs the agent's objects in this process (isinstance checks against the task's classes,
catching the task's own exception classes, monkeypatching the task's modules, passing
callables to the code under test). A hidden test that needs those fails; write it with
plain values.
"""
from __future__ import annotations

import builtins
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import select
import sys
import time
import types

from jaxrl_agent.env.code_server import MAX_LINE, CodecError, decode, dumps, encode, write_all


class RemoteError(Exception):
    """The code under test raised an exception that is not a builtin."""


class NoAnswer(Exception):
    """The code under test did not answer (timeout, crash, malformed or oversized reply)."""


class Channel:
    """The judge's end of the pipe pair to the child; one request in flight at a time.

    While it waits for an answer it also drains the child's stdout and stderr (`sinks`,
    kept up to `cap` bytes each), so a chatty child never blocks on a full pipe; no thread
    is needed (none can be started after the call's PID namespace is made).
    """

    def __init__(self, wfd: int, rfd: int, call_wall_s: float, deadline: float, on_dead,
                 sinks: list[int] = (), cap: int = 1 << 16):
        self.wfd, self.rfd = wfd, rfd
        self.order, self.sinks, self.cap = list(sinks), list(sinks), cap
        self.outputs = {fd: bytearray() for fd in sinks}
        self.call_wall_s, self.deadline, self._on_dead = call_wall_s, deadline, on_dead
        self.dead: str | None = None
        self.timed_out = False
        self.calls = 0
        self._buf = bytearray()

    def request(self, req: dict) -> dict:
        if self.dead:
            raise NoAnswer(self.dead)
        self.calls += 1
        try:
            write_all(self.wfd, dumps(req))
        except OSError:
            self._kill("the code under test exited")
        line = self._readline(min(time.monotonic() + self.call_wall_s, self.deadline))
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            reply = None
        if not isinstance(reply, dict) or len(reply) != 1:
            self._kill("malformed reply from the code under test")
        return reply

    def _readline(self, until: float) -> bytes:
        while True:
            i = self._buf.find(b"\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[:i + 1]
                return line
            if len(self._buf) > MAX_LINE:
                self._kill("reply larger than the limit")
            left = until - time.monotonic()
            ready = select.select([self.rfd, *self.sinks], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                self.timed_out = time.monotonic() >= self.deadline
                self._kill(f"no answer within {self.call_wall_s:g} s (a loop or a sleep?)")
            for fd in ready:
                if fd != self.rfd:
                    self._sink(fd)
                    continue
                chunk = os.read(self.rfd, 1 << 16)
                if not chunk:
                    self._kill("the code under test exited")
                self._buf += chunk

    def _sink(self, fd: int) -> bool:
        """Read once from a sink; False when it has nothing more now."""
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            self.sinks.remove(fd)
            return False
        out = self.outputs[fd]
        out += chunk[: max(0, self.cap - len(out))]
        return True

    def finish(self) -> list[bytes]:
        """After the child is gone: read what is left; the sinks' bytes in their order."""
        for fd in list(self.sinks):
            os.set_blocking(fd, False)
            while fd in self.sinks and self._sink(fd):
                pass
        return [bytes(self.outputs[fd]) for fd in self.order]

    def _kill(self, why: str):
        self.dead = why
        self._on_dead()
        raise NoAnswer(why)


def _answer(channel: Channel, reply: dict, make_callable):
    """A reply -> a plain value, a callable proxy, or a raised exception."""
    kind = next(iter(reply))
    if kind == "ok":
        try:
            return decode(reply["ok"], lambda i: RemoteObject(channel, i))
        except CodecError as e:
            raise NoAnswer(f"not plain data: {e}") from None
    if kind == "callable" and reply["callable"] is True:
        return make_callable()
    if kind == "raise" and isinstance(reply["raise"], dict):
        name, msg = reply["raise"].get("type"), reply["raise"].get("msg")
        msg = msg if isinstance(msg, str) else ""
        cls = getattr(builtins, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                exc = cls(msg)
            except Exception:  # noqa: BLE001 - constructors with other signatures
                exc = RemoteError(f"{name}: {msg}")
        else:
            exc = RemoteError(f"{name}: {msg}")
        raise exc
    channel._kill("malformed reply from the code under test")


def _encode_arg(value):
    if isinstance(value, RemoteObject):
        return {"__t": "ref", "v": object.__getattribute__(value, "_ref")}
    raise TypeError(f"a hidden test passed a {type(value).__name__} to the code under test; "
                    "only plain data and handles cross the judge boundary")


class RemoteCallable:
    """A function, class or method of the code under test, called over the channel."""

    def __init__(self, channel: Channel, target: dict, path: list[str]):
        self._channel, self._target, self._path = channel, target, path

    def __call__(self, *args, **kwargs):
        req = {"op": "call", **self._target, "path": self._path,
               "args": encode(list(args), _encode_arg), "kwargs": encode(dict(kwargs), _encode_arg)}
        return _answer(self._channel, self._channel.request(req), lambda: None)

    def __repr__(self):
        return f"<remote {'.'.join(self._path)}>"


class RemoteObject:
    """A handle to an object that lives in the child: attributes and methods only."""

    __slots__ = ("_channel", "_ref")

    def __init__(self, channel: Channel, ref: int):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_ref", ref)

    def __getattr__(self, name: str):
        channel, ref = object.__getattribute__(self, "_channel"), object.__getattribute__(self, "_ref")
        target = {"ref": ref}
        reply = channel.request({"op": "get", **target, "path": [name]})
        return _answer(channel, reply, lambda: RemoteCallable(channel, target, [name]))

    def __eq__(self, other):
        return NotImplemented

    __hash__ = object.__hash__

    def __bool__(self):
        raise TypeError("a handle to an object of the code under test has no truth value")

    def __repr__(self):
        return f"<remote object #{object.__getattribute__(self, '_ref')}>"


class ProxyModule(types.ModuleType):
    """Stands for a task module in the judge: attribute reads ask the child."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        channel = vars(self)["_jxa_channel"]
        if f"{self.__name__}.{name}" in vars(self)["_jxa_modules"]:  # a submodule
            return importlib.import_module(f"{self.__name__}.{name}")
        target = {"mod": self.__name__}
        reply = channel.request({"op": "get", **target, "path": [name]})
        value = _answer(channel, reply, lambda: RemoteCallable(channel, target, [name]))
        setattr(self, name, value)  # one round trip per name
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the task's module names (and their parent packages) as proxies."""

    def __init__(self, channel: Channel, modules: list[str]):
        self.channel = channel
        self.modules = set(modules)
        self.packages = {".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 1)}

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.modules or fullname in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname in self.packages)
        return None

    def create_module(self, spec):
        mod = ProxyModule(spec.name)
        vars(mod)["_jxa_channel"] = self.channel
        vars(mod)["_jxa_modules"] = self.modules
        if spec.name in self.packages:
            mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


def module_names(paths) -> list[str]:
    """Importable module names of a task's source paths ("pkg/mod.py" -> "pkg.mod")."""
    names = []
    for rel in paths:
        if not rel.endswith(".py"):
            continue
        parts = rel[:-3].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and all(p.isidentifier() for p in parts):
            names.append(".".join(parts))
    return sorted(set(names))


def install(channel: Channel, modules: list[str]) -> None:
    """Route imports of `modules` to proxies (first on `sys.meta_path`)."""
    for name in list(sys.modules):
        if name in modules or any(name == m.split(".")[0] for m in modules):
            del sys.modules[name]
    sys.meta_path.insert(0, _Finder(channel, modules))
