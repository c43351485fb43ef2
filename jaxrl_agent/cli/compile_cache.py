"""HOST: JAX's persistent compilation cache, on by default for the CLI and the study.

Why: a run compiles the sampler's prefill/decode buckets and the train step's length buckets
before its first iteration. Compiles are the same every run of the same shapes, so the second
run of `python -m jaxrl_agent demo` loads them from disk instead (`benchmarks/bench_startup.py`
measures the time to the first iteration, cold cache against warm).

    enable()  ->  <cache root>/<jax, jaxlib, machine and CPU fingerprint>/   (jax_compilation_cache_dir)
                                                                  programs/ (program_store.py: the
                                                                  train step's and sampler's programs
                                                                  by shape, loaded without tracing)

Where: `$JAXRL_AGENT_COMPILE_CACHE` if set (a directory, or `off` to disable), else
`$XDG_CACHE_HOME/jaxrl_agent/xla`, else `~/.cache/jaxrl_agent/xla`. The CLI's
`--compile_cache=DIR|off` overrides both.

Safe across versions and machines: JAX's own cache key already covers the computation, the
compile options, the XLA flags and the jax/jaxlib versions. Each (jax, jaxlib, machine, CPU
features) combination still gets its own subdirectory: an XLA:CPU executable is machine code
for the host that compiled it, so a cache shared between machines (an NFS home directory) must
never hand one host's executable to another CPU, and an upgrade leaves the old entries in a
directory that can be deleted whole. The cache is bounded (`MAX_BYTES`, least recently used
entries evicted by JAX).

Leaf module: no project imports.
"""
from __future__ import annotations

import hashlib
import os
import platform

ENV_VAR = "JAXRL_AGENT_COMPILE_CACHE"
OFF = ("off", "0", "false", "no", "none", "")
MAX_BYTES = 2 << 30
# Entries are written for every compile, however short: the sampler's many small buckets add up
# to most of the wait (benchmarks/bench_startup.py), and an entry of a tiny model is kilobytes.
MIN_COMPILE_SECONDS = 0.0


def _cpu_fingerprint() -> str:
    """The host CPU's model and feature flags (Linux /proc/cpuinfo; elsewhere the platform)."""
    text = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU implementer", "CPU part"):
                    text += line
                if key == "processor" and line.split(":", 1)[1].strip() != "0":
                    break  # the first core's lines describe them all
    except OSError:
        pass
    return text


def cache_root(setting: str | None = None, env: dict | None = None) -> str | None:
    """The cache's root directory for `setting` (a directory, `off`, or None for the default),
    or None when the cache is off."""
    env = os.environ if env is None else env
    value = setting if setting is not None else env.get(ENV_VAR)
    if value is not None:
        return None if value.strip().lower() in OFF else os.path.expanduser(value)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxrl_agent", "xla")


def cache_dir(root: str) -> str:
    """`root/<key>`: one directory per jax, jaxlib, machine and CPU feature set."""
    import jax
    import jaxlib

    ident = f"{jax.__version__}|{jaxlib.__version__}|{platform.machine()}|{_cpu_fingerprint()}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:12]
    return os.path.join(root, f"jax{jax.__version__}-jaxlib{jaxlib.__version__}-{platform.machine()}-{digest}")


def enable(setting: str | None = None) -> str | None:
    """Turn the persistent cache on (see module docstring); returns its directory, or None
    when it is off or the directory cannot be created (then compiles are simply not cached).
    Touches no backend, so it may run before `jax.distributed.initialize`."""
    import jax

    root = cache_root(setting)
    if root is None:
        return None
    path = cache_dir(root)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a read-only home must not stop a run: it only costs compile time
        print(f"compile cache off: cannot create {path} ({e}); set {ENV_VAR}=DIR to choose another place")
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
