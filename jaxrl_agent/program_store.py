"""HOST: a jitted function's traced program kept on disk by argument shapes, so that a later
process skips tracing and lowering and goes straight to the (cached) XLA compile.

Why: JAX's persistent compilation cache is keyed by the lowered module, so a warm start still
traces and lowers every program before it can look the executable up: for the demo that is
most of the compile seconds left in a warm start (`benchmarks/bench_startup.py` reports them).
A program exported with `jax.export` by argument shapes needs neither on the next run.

    StoredJit(jitted, name, fingerprint)(*args)
      -> signature (tree structure; shape, dtype, weak type, sharding per leaf)
      -> in memory?  else  <jax compilation cache dir>/programs/<name>-<key>.bin ?
             yes: deserialize the exported module (no tracing)
             no:  trace once with jax.export, write the file (atomic)
      -> jax.jit(exported.call).lower().compile()   (the persistent cache hit on a warm start)

The key is everything that decides the trace: `name`, the caller's `fingerprint` (the values
its traced function closes over, e.g. the train step's constructor arguments) and the jit's own
settings, a digest of this package's source files, the jax / jaxlib / flax / optax / numpy
versions, JAX's trace settings (x64, matmul precision, ...) and XLA flags, the backend and its
devices, and the signature. `fingerprint` turns configs, functions (code, defaults, closure
cells, referenced globals) and arrays into text; anything it cannot describe exactly (an
object whose repr is its address) turns the store off for that function, which then runs as
the plain jit: a wrong program is never loaded, a program is at worst traced again.

Trust: a file here is loaded with pickle and run as a program, as the executables beside it in
JAX's own cache are; whoever can write either directory already runs code in the trainer, so
the store adds no new way in (the sandbox's "namespaces" and "uid" levels run the agent's code
as another user, who cannot write the trainer's home; "basic" confines no files, env/sandbox.py).

The store is on only where JAX's persistent cache is (the CLI and the study turn it on,
cli/compile_cache.py; tests and library users that never set it get the plain jit), in one
process (`jax.process_count() == 1`), with `flatbuffers` installed; a function that cannot be
exported (host callbacks) falls back to the plain jit once, with a warning.

Leaf module: no project imports.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pickle
import sys
import threading
import types
import warnings
from concurrent.futures import Future
from typing import Any, Callable

import jax
import numpy as np

FORMAT = 1  # bump when the file layout changes
DIRECTORY: str | None = None  # where programs go when set; None: `programs/` beside JAX's persistent cache
# Every edit of the package re-keys every program, so old files pile up: the least recently
# used go once the directory passes this size (a program of the demo's train step is ~150 KB).
MAX_BYTES = 256 << 20
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy")


class Unfingerprintable(TypeError):
    """An object `fingerprint` cannot describe exactly (the store turns off for its function)."""


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of this package's Python sources (paths and bytes): any edit re-keys every program."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(_PACKAGE_DIR):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, _PACKAGE_DIR).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _environment() -> str:
    versions = [f"{lib}={getattr(sys.modules.get(lib), '__version__', None)}" for lib in _LIBRARIES]
    devices = [f"{d.platform}:{d.device_kind}:{d.id}" for d in jax.devices()]
    return "|".join([f"format={FORMAT}", source_digest(), *versions, jax.default_backend(), *devices])


def _trace_context() -> tuple:
    """JAX's settings a trace reads (x64, matmul precision, promotion rules, ...), thread-local
    overrides included: what `jax.jit` keys its own trace cache by (`trace_context`, private;
    the global values where it is missing)."""
    try:
        from jax._src import config as jax_config

        return tuple(jax_config.trace_context())
    except (ImportError, AttributeError):
        return tuple(sorted(jax.config.values.items()))


def _trace_settings(context: tuple) -> str:
    """`_trace_context()` as text for the file key (less objects known only by address), and
    the XLA flags."""
    return repr([x for x in context if " at 0x" not in repr(x)]) + "|" + os.environ.get("XLA_FLAGS", "")


def fingerprint(obj: Any, _seen: frozenset = frozenset()) -> str:
    """Text that equals another object's exactly when both trace the same (see module docstring).

    Raises `Unfingerprintable` for objects it cannot describe."""
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return f"{type(obj).__name__}:{obj!r}"
    if id(obj) in _seen:
        return "<cycle>"
    seen = _seen | {id(obj)}
    fp = functools.partial(fingerprint, _seen=seen)
    if isinstance(obj, (np.generic, np.dtype)):
        return f"np:{obj.dtype if isinstance(obj, np.generic) else ''}:{obj!r}"
    if isinstance(obj, type):
        return f"type:{obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.ModuleType):
        return f"module:{obj.__name__}"
    if isinstance(obj, (np.ndarray, jax.Array)):
        a = np.asarray(obj)
        return f"array:{a.dtype}:{a.shape}:{hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()}"
    if isinstance(obj, jax.ShapeDtypeStruct):
        return f"sds:{obj.shape}:{obj.dtype}:{obj.weak_type}:{obj.sharding!r}"
    if isinstance(obj, (jax.sharding.Sharding, jax.sharding.Mesh, jax.sharding.PartitionSpec)):
        return f"{type(obj).__name__}:{obj!r}"
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(map(fp, obj)) if isinstance(obj, (set, frozenset)) else list(map(fp, obj))
        return f"{type(obj).__qualname__}[{','.join(items)}]"
    if isinstance(obj, dict):
        return f"{type(obj).__qualname__}{{{','.join(sorted(f'{fp(k)}:{fp(v)}' for k, v in obj.items()))}}}"
    if isinstance(obj, functools.partial):
        return f"partial({fp(obj.func)},{fp(obj.args)},{fp(obj.keywords)})"
    if isinstance(obj, types.MethodType):
        return f"method({fp(obj.__func__)},{fp(obj.__self__)})"
    if isinstance(obj, types.FunctionType):
        return _function(obj, fp)
    if isinstance(obj, (types.BuiltinFunctionType, np.ufunc)):
        return f"builtin:{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', obj.__name__)}"
    if dataclasses.is_dataclass(obj):
        fields = ",".join(f"{f.name}={fp(getattr(obj, f.name))}" for f in dataclasses.fields(obj))
        return f"{type(obj).__module__}.{type(obj).__qualname__}({fields})"
    text = repr(obj)
    if " at 0x" in text or text.startswith("<"):
        raise Unfingerprintable(f"cannot fingerprint {type(obj).__module__}.{type(obj).__qualname__}: {text[:80]}")
    return f"{type(obj).__module__}.{type(obj).__qualname__}:{text}"


def _code(code: types.CodeType, fp: Callable) -> str:
    consts = [_code(c, fp) if isinstance(c, types.CodeType) else fp(c) for c in code.co_consts]
    return f"code({code.co_qualname},{code.co_code.hex()},{consts},{code.co_names})"


def _function(fn: types.FunctionType, fp: Callable) -> str:
    """Code, defaults, closure cells and (for code outside site-packages and this package,
    whose versions and sources are in the key already) the module globals it reads."""
    cells = [fp(c.cell_contents) if _filled(c) else "<empty>" for c in (fn.__closure__ or ())]
    parts = [f"{fn.__module__}.{fn.__qualname__}", _code(fn.__code__, fp), fp(fn.__defaults__),
             fp(fn.__kwdefaults__), ",".join(cells)]
    origin = getattr(sys.modules.get(fn.__module__), "__file__", None) or ""
    if not (origin.startswith(_PACKAGE_DIR) or "site-packages" in origin or "dist-packages" in origin):
        g = fn.__globals__
        names = sorted({n for n in _all_names(fn.__code__) if n in g})
        parts.append(",".join(f"{n}={fp(g[n])}" for n in names))
    return "fn(" + ";".join(parts) + ")"


def _all_names(code: types.CodeType) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _all_names(c)
    return names


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def store_dir() -> str | None:
    """Where programs are kept: `DIRECTORY`, else `programs/` beside JAX's persistent cache; None
    when the store is off (neither set, several processes, no `flatbuffers`)."""
    root = jax.config.jax_compilation_cache_dir
    if DIRECTORY is None and not root or jax.process_count() > 1:
        return None
    try:
        import flatbuffers  # noqa: F401  (jax.export's serialization needs it)
    except ImportError:
        return None
    return DIRECTORY if DIRECTORY is not None else os.path.join(root, "programs")


def _abstract(x) -> jax.ShapeDtypeStruct:
    """The leaf's shape, dtype, weak type and sharding; a placement on the default device alone
    counts as none (where a NumPy argument lands), so both share one program."""
    if isinstance(x, (jax.ShapeDtypeStruct, jax.Array)):
        sharding = x.sharding
        if isinstance(sharding, jax.sharding.SingleDeviceSharding) and sharding.device_set == {jax.devices()[0]}:
            sharding = None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)
    if isinstance(x, (bool, int, float, complex)):  # Python scalars trace weakly typed
        return jax.ShapeDtypeStruct((), jax.dtypes.canonicalize_dtype(np.asarray(x).dtype), weak_type=True)
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, jax.dtypes.canonicalize_dtype(x.dtype))


class StoredJit:
    """`jax.jit(fn, **jit_kwargs)` (`.jitted`), its programs kept by argument shapes (module
    docstring). `fingerprint_of`: what `fn`'s trace reads besides its arguments.

    `stored(*args)` runs like `jitted(*args)`; `program(*args)` (args concrete or
    ShapeDtypeStructs) returns the compiled callable for those shapes, loading or exporting it,
    thread-safe (a second caller of the same shapes waits for the first). With the store off,
    both are the plain jit's (`program` compiles with `jitted.lower(*args).compile()`)."""

    def __init__(self, fn: Callable, name: str, fingerprint_of: Any, **jit_kwargs):
        self.name = name
        self.jitted = jax.jit(fn, **jit_kwargs)
        # Exported inside an outer jit, which takes the compiler options (a nested jit may not)
        self._inner = jax.jit(fn, **{k: v for k, v in jit_kwargs.items() if k != "compiler_options"})
        donate = jit_kwargs.get("donate_argnums", ())
        self._donate = (donate,) if isinstance(donate, int) else tuple(donate)
        self._options = jit_kwargs.get("compiler_options")
        self._programs: dict = {}
        self._lock = threading.Lock()
        try:  # the jit's own settings (shardings, donation, options) are part of what it compiles
            self._fingerprint = hashlib.sha256(fingerprint((fingerprint_of, jit_kwargs)).encode()).hexdigest()
        except Unfingerprintable:  # the plain jit, every call
            self._fingerprint = None
        self.lower = self.jitted.lower

    def enabled(self) -> bool:
        return self._fingerprint is not None and store_dir() is not None

    def __call__(self, *args):
        if not self.enabled():
            return self.jitted(*args)
        return self.program(*args)(*args)

    def _cache_size(self) -> int:
        return self.jitted._cache_size() + len(self._programs)

    def program(self, *args) -> Callable:
        leaves, tree = jax.tree.flatten(args)
        avals = tuple(_abstract(x) for x in leaves)
        context = _trace_context()  # as jit: other settings, another program
        sig = (tree, tuple((a.shape, a.dtype, a.weak_type, a.sharding) for a in avals), context)
        with self._lock:
            future = self._programs.get(sig)
            owner = future is None
            if owner:
                future = self._programs[sig] = Future()
        if not owner:
            return future.result()
        try:
            future.set_result(self._build(tree, avals, context))
        except BaseException as e:
            future.set_exception(e)
            with self._lock:
                self._programs.pop(sig, None)
            raise
        return future.result()

    def _build(self, tree, avals: tuple, context: tuple) -> Callable:
        directory = store_dir()
        if directory is None or self._fingerprint is None:
            return self.jitted.lower(*jax.tree.unflatten(tree, avals)).compile()
        donated = self._flat_donated(tree)
        sig_text = repr((str(tree), [(a.shape, str(a.dtype), a.weak_type, repr(a.sharding)) for a in avals], donated))
        key = hashlib.sha256("\n".join([_environment(), _trace_settings(context), self.name, self._fingerprint,
                                        sig_text]).encode()).hexdigest()
        path = os.path.join(directory, f"{self.name}-{key[:32]}.bin")
        loaded = _read(path)
        if loaded is None:
            try:
                loaded = self._export(tree, avals, donated)
            except Exception as e:  # noqa: BLE001  (e.g. a host callback: not serializable)
                warnings.warn(f"{self.name}: not exported ({type(e).__name__}: {e}); tracing it every run", stacklevel=3)
                self._fingerprint = None
                return self.jitted.lower(*jax.tree.unflatten(tree, avals)).compile()
            _write(path, loaded)
        exported, out_tree = loaded
        compiled = jax.jit(exported.call, donate_argnums=donated,
                           compiler_options=self._options).lower(*avals).compile()

        def run(*args):
            return jax.tree.unflatten(out_tree, compiled(*jax.tree.leaves(args)))

        return run

    def _flat_donated(self, tree) -> tuple[int, ...]:
        """Flat leaf indices of the donated arguments."""
        counts = [c.num_leaves for c in tree.children()]
        starts = np.cumsum([0, *counts])
        return tuple(i for a in self._donate for i in range(starts[a], starts[a] + counts[a]))

    def _export(self, tree, avals: tuple, donated: tuple) -> tuple:
        from jax import export

        out_tree = None

        def flat(*leaves):
            nonlocal out_tree
            out = self._inner(*jax.tree.unflatten(tree, leaves))
            flat_out, out_tree = jax.tree.flatten(out)
            return flat_out

        in_shardings = tuple(a.sharding for a in avals)
        jitted = jax.jit(flat, donate_argnums=donated,
                         in_shardings=in_shardings if all(s is not None for s in in_shardings) else None)
        exported = export.export(jitted)(*avals)
        return exported, out_tree


def _read(path: str):
    """(Exported, out tree) from `path`, or None (missing or unreadable: it is rebuilt)."""
    try:
        with open(path, "rb") as f:
            record = pickle.load(f)
        if record.get("format") != FORMAT:
            return None
        from jax import export

        loaded = export.deserialize(bytearray(record["exported"])), record["out_tree"]
        os.utime(path)  # used now: the last to be evicted
        return loaded
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001  (a truncated or foreign file: export again, overwrite it)
        return None


def _write(path: str, loaded: tuple) -> None:
    exported, out_tree = loaded
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump({"format": FORMAT, "exported": exported.serialize(), "out_tree": out_tree}, f)
        os.replace(tmp, path)
        _evict(os.path.dirname(path), MAX_BYTES)
    except OSError as e:  # a read-only or full disk: the program still runs, it is traced again next time
        warnings.warn(f"program store: could not write {path} ({e})", stacklevel=4)


def _evict(directory: str, max_bytes: int) -> None:
    """Delete the least recently used programs until the directory holds at most `max_bytes`."""
    entries = []
    for entry in os.scandir(directory):
        if entry.name.endswith(".bin"):
            try:
                st = entry.stat()
            except OSError:  # removed by another process meanwhile
                continue
            entries.append((st.st_mtime, st.st_size, entry.path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        try:
            os.remove(path)
        except OSError:
            pass
        total -= size
