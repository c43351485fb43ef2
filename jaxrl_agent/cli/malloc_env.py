"""HOST: start the process with tcmalloc when the machine has it.

Why: XLA:CPU allocates the temporaries of each call in one block and frees it when the call
returns. For the tiny-model GRPO step of `benchmarks/bench_train_step.py` that block is
782 MB (its `xla_temp_bytes_per_step`). glibc's malloc serves a block that large with a
fresh `mmap` every time and unmaps it on free, so every step faults its scratch in again,
4 KiB at a time. tcmalloc keeps freed pages for the next call. The benchmark measures both
settings (`--malloc tcmalloc`, its default, and `--malloc default`); the figures are in the
README. Tried by hand and dropped: glibc asking for transparent huge pages
(GLIBC_TUNABLES=glibc.malloc.hugetlb=1) and jemalloc, both slower than tcmalloc once torch
shared the process.

A preload only works from process start, so the entry points (`python -m jaxrl_agent`,
`python -m experiments.binary_search_rl`, the train-step benchmark) call
`reexec_with_tcmalloc()` first. It replaces the process, once, by the same command line with
LD_PRELOAD naming tcmalloc. The library comes from the OS (Debian/Ubuntu:
`apt-get install libtcmalloc-minimal4`); without it nothing changes. Set
JAXRL_AGENT_MALLOC=default to keep the process as started.
"""
from __future__ import annotations

import ctypes.util
import os
import sys

OPT_OUT_VAR = "JAXRL_AGENT_MALLOC"  # "default": keep the C library's malloc
_GUARD_VAR = "_JAXRL_AGENT_MALLOC_REEXEC"  # set in the re-executed process: never loop
# tcmalloc reports every allocation above 1 GiB on stderr; XLA's per-call scratch of a larger
# model passes that on every step. Raised unless the user set it.
_REPORT_VAR = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"
_REPORT_BYTES = str(1 << 40)


def find_tcmalloc() -> str | None:
    """The tcmalloc shared library's name as the dynamic loader finds it, or None."""
    for name in ("tcmalloc_minimal", "tcmalloc"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def tcmalloc_active(environ: dict[str, str] | None = None) -> bool:
    """True when this process was started with tcmalloc preloaded (by us or the user)."""
    return "tcmalloc" in (os.environ if environ is None else environ).get("LD_PRELOAD", "")


def tcmalloc_env(environ: dict[str, str], *, system: str, library: str | None) -> dict[str, str] | None:
    """The environment to re-exec with, or None when the process should stay as it is.

    Args:
      environ: the current environment.
      system: `sys.platform`; library: `find_tcmalloc()`.
    """
    if environ.get(OPT_OUT_VAR, "").lower() == "default" or environ.get(_GUARD_VAR):
        return None
    if not system.startswith("linux") or library is None or tcmalloc_active(environ):
        return None
    env = dict(environ)
    other = environ.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = f"{library}:{other}" if other else library
    env.setdefault(_REPORT_VAR, _REPORT_BYTES)
    env[_GUARD_VAR] = "1"
    return env


def without_tcmalloc(environ: dict[str, str]) -> dict[str, str]:
    """`environ` for a child process that must run with the default malloc."""
    env = dict(environ)
    kept = [p for p in env.pop("LD_PRELOAD", "").replace(" ", ":").split(":") if p and "tcmalloc" not in p]
    if kept:
        env["LD_PRELOAD"] = ":".join(kept)
    env[OPT_OUT_VAR] = "default"
    env.pop(_GUARD_VAR, None)
    return env


def reexec_with_tcmalloc() -> None:
    """Replace this process by the same command with tcmalloc preloaded.

    Returns (doing nothing) when that does not apply: not Linux, no tcmalloc on the machine,
    already preloaded, JAXRL_AGENT_MALLOC=default, or already re-executed. Call it first
    thing in a `__main__`, before JAX starts.
    """
    env = tcmalloc_env(dict(os.environ), system=sys.platform, library=find_tcmalloc())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
