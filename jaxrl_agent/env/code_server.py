"""The code under test as a server of plain-data calls (HOST; runs inside the untrusted child).

For a `verify`, the sandboxed child never sees a test: it imports the task's modules and
answers calls that the judge process (`judge.py`) sends it, one JSON line each way:

    judge (hidden tests, comparisons)             child (agent's code, jailed, own uid)
      remote_fn(*args) -- {"op": "call", ...} -->   serve(): import module, call, encode
      decode(...)      <-- {"ok": value} ---------   or {"raise": {type, msg}}

Everything that crosses is *plain data*, tagged so the judge gets back exactly the types
the code returned (`encode` / `decode`): None, bool, int, float, str, bytes, list, tuple,
dict, set, frozenset, and `ref` handles to instances of classes defined in the task's own
modules (the judge may call their methods but never compares them). The child's encoder
is a convenience, not a defence: the judge's `decode` builds only these types from
whatever bytes arrive, so nothing the child controls (an always-equal object, an int
subclass, a patched `json`) ever reaches a comparison.

Leaf module: no project imports (it is imported in the jail by the pre-warmed worker).
"""
from __future__ import annotations

import importlib
import json
import math
import os
import signal
import sys

MAX_LINE = 1 << 20  # longest request/reply line in bytes; longer replies fail the call
MAX_DEPTH = 64  # deepest nesting of a value


class CodecError(ValueError):
    """A value that is not plain data (or is too large / too deep)."""


# ---- the codec (one home: both ends use these two functions) ----


def encode(value, on_other=None, depth: int = 0):
    """Python value -> JSON-able tagged tree. A value of any other type goes to
    `on_other(value) -> tree` (which makes a handle or raises); without it, `CodecError`."""
    if depth > MAX_DEPTH:
        raise CodecError(f"value nested deeper than {MAX_DEPTH}")
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if abs(value) < 2**53 else {"__t": "int", "v": str(value)}
    if t is float:
        return value if math.isfinite(value) else {"__t": "float", "v": repr(value)}
    if t is list:
        return [encode(v, on_other, depth + 1) for v in value]
    if t in (tuple, set, frozenset):
        items = sorted(value, key=repr) if t is not tuple else value
        return {"__t": t.__name__, "v": [encode(v, on_other, depth + 1) for v in items]}
    if t is dict:
        return {"__t": "dict", "v": [[encode(k, on_other, depth + 1), encode(v, on_other, depth + 1)]
                                     for k, v in value.items()]}
    if t is bytes:
        return {"__t": "bytes", "v": value.hex()}
    if on_other is not None:
        return on_other(value)
    raise CodecError(f"a value of type {t.__name__} is not plain data")


def decode(tree, make_ref=None, depth: int = 0):
    """Tagged tree (from `json.loads`) -> a value built only of plain types.

    `make_ref(i)` turns a handle into the judge's proxy; without it a handle is refused.
    Raises `CodecError` for anything else, whatever the tree holds.
    """
    if depth > MAX_DEPTH:
        raise CodecError(f"value nested deeper than {MAX_DEPTH}")
    t = type(tree)
    if tree is None or t in (bool, str, float):
        return tree
    if t is int:
        return int(tree)
    if t is list:
        return [decode(v, make_ref, depth + 1) for v in tree]
    if t is not dict or set(tree) != {"__t", "v"}:
        raise CodecError(f"malformed value {str(tree)[:80]!r}")
    tag, v = tree["__t"], tree["v"]
    if tag in ("tuple", "set", "frozenset") and type(v) is list:
        items = [decode(x, make_ref, depth + 1) for x in v]
        try:
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        except TypeError as e:  # an unhashable member of a set
            raise CodecError(str(e)) from None
    if tag == "dict" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
        try:
            return {decode(k, make_ref, depth + 1): decode(x, make_ref, depth + 1) for k, x in v}
        except TypeError as e:
            raise CodecError(str(e)) from None
    if tag == "int" and type(v) is str and len(v) <= 4300:
        try:
            return int(v)
        except ValueError:
            pass
    if tag == "float" and v in ("inf", "-inf", "nan"):
        return float(v)
    if tag == "bytes" and type(v) is str:
        try:
            return bytes.fromhex(v)
        except ValueError:
            pass
    if tag == "ref" and type(v) is int and make_ref is not None:
        return make_ref(v)
    raise CodecError(f"malformed value {str(tree)[:80]!r}")


def dumps(obj) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode()


# ---- the child's loop ----


class _CallTimeout(BaseException):
    pass


def _on_prof(signum, frame):
    raise _CallTimeout()


def _resolve(req: dict, objects: list, modules: set[str]):
    """The object a request names: a task module's attribute, or a handle's."""
    path = req.get("path")
    if not (isinstance(path, list) and path and all(isinstance(p, str) for p in path)):
        raise CodecError("bad path")
    if "ref" in req:
        obj = objects[req["ref"]]
    else:
        name = req.get("mod")
        if name not in modules:
            raise ImportError(f"no task module {name!r}")
        obj = importlib.import_module(name)
    for p in path:
        obj = getattr(obj, p)
    return obj


def _reply(obj, objects: list, modules: set[str]) -> dict:
    """Encode a result; handles only for instances of the task modules' own classes."""
    def handle(value):
        if isinstance(value, type) or callable(value) or \
                getattr(type(value), "__module__", None) not in modules:
            raise CodecError(f"a value of type {type(value).__name__} is not plain data")
        objects.append(value)
        return {"__t": "ref", "v": len(objects) - 1}
    return {"ok": encode(obj, handle)}


def serve(rfd: int, wfd: int, modules: list[str], call_cpu_s: float | None) -> int:
    """Answer the judge's requests until EOF; returns the exit code.

    Requests: {"op": "get"|"call", "mod": name | "ref": i, "path": [attr, ...], "args": tree,
    "kwargs": tree}. "get" answers {"ok": value} for plain data or {"callable": True};
    a raised exception answers {"raise": {"type": name, "msg": text}}. Each call gets
    `call_cpu_s` CPU seconds (SIGPROF), so a looping call fails alone with a clear message.
    """
    mods, objects, me = set(modules), [], os.getpid()
    reader = os.fdopen(rfd, "rb")
    if call_cpu_s:
        signal.signal(signal.SIGPROF, _on_prof)
    while True:
        line = _readline(reader)
        if not line:
            return 0
        try:
            req = json.loads(line)  # from the judge: trusted
            op = req["op"]
            if call_cpu_s:
                signal.setitimer(signal.ITIMER_PROF, call_cpu_s)
            try:
                target = _resolve(req, objects, mods)
                if op == "get":
                    out = {"callable": True} if callable(target) else {"ok": encode(target)}
                elif op == "call":
                    args = decode(req.get("args", []), objects.__getitem__)
                    kwargs = decode(req.get("kwargs", {"__t": "dict", "v": []}), objects.__getitem__)
                    out = _reply(target(*args, **kwargs), objects, mods)
                else:
                    raise CodecError(f"unknown op {op!r}")
            finally:
                if call_cpu_s:
                    signal.setitimer(signal.ITIMER_PROF, 0)
        except _CallTimeout:
            out = {"raise": {"type": "TimeoutError",
                             "msg": f"timed out: the call used more than {call_cpu_s:g} s of CPU time (an infinite loop?)"}}
        except CodecError as e:
            out = {"raise": {"type": "NotPlainData", "msg": str(e)}}
        except Exception as e:  # noqa: BLE001 - the judge decides what an exception means
            out = {"raise": {"type": type(e).__name__, "msg": str(e)[:2000]}}
        if os.getpid() != me:  # a copy forked by the code under test never answers
            os._exit(0)
        try:
            data = dumps(out)
        except (TypeError, ValueError) as e:
            data = dumps({"raise": {"type": "NotPlainData", "msg": str(e)[:200]}})
        if len(data) > MAX_LINE:
            data = dumps({"raise": {"type": "NotPlainData", "msg": "result too large"}})
        sys.stdout.flush()
        write_all(wfd, data)


def _readline(reader) -> bytes:
    line = reader.readline(MAX_LINE + 1)
    return line if line.endswith(b"\n") else b""


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
