"""HOST: metrics to JSONL + TensorBoard, wall-clock timers, and progress bars.

    log = MetricsLogger("runs/x")              # runs/x/metrics.jsonl (+ TensorBoard events)
    log.log(step, {"reward": 0.5, "eval": {"pass1": 0.2}})   # nested dicts -> "eval/pass1"
    watch_compiles(); ...; compile_seconds()   # JAX's compile time in this process so far
    with progress_bar(total=64, description="rollout") as advance: ... advance(n_done, n_total)
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from typing import Any, Iterator

from jaxrl_agent.loops.tensorboard_events import EventWriter


def flatten(metrics: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a/b": 1}; leaves non-dict values as they are."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def _jsonable(v):
    if hasattr(v, "item") and getattr(v, "size", 2) == 1:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN / inf
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def _open_writer(logdir: str) -> EventWriter:
    return EventWriter(logdir)


class MetricsLogger:
    """Appends one JSON object per `log` call to `<run_dir>/metrics.jsonl` and writes the
    numeric entries as TensorBoard scalars (`<run_dir>/tb`, loops/tensorboard_events.py) when
    `tensorboard` is True. With `enabled=False` (every process of a multi-host job but the
    first) it writes nothing and `log` only returns the flattened metrics."""

    def __init__(self, run_dir: str, tensorboard: bool = True, enabled: bool = True):
        self.enabled = enabled
        self._file = self._tb = None
        self._tb_dir = os.path.join(run_dir, "tb") if tensorboard else None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a", buffering=1)  # line-buffered: a kill loses no line

    def _writer(self) -> EventWriter | None:
        """The TensorBoard writer, opened by the first `log` (after its JSON line is written, so
        a writer that cannot open loses no metrics); None without TensorBoard."""
        if self._tb is None and self._tb_dir is not None:
            self._tb = _open_writer(self._tb_dir)
        return self._tb

    def log(self, step: int, metrics: dict) -> dict:
        flat = {k: _jsonable(v) for k, v in flatten(metrics).items()}
        if not self.enabled:
            return flat
        self._file.write(json.dumps({"step": int(step), "time": time.time(), **flat}) + "\n")
        tb = self._writer()
        if tb is not None:
            tb.add_scalars(step, {k: v for k, v in flat.items()
                                  if isinstance(v, (int, float)) and not isinstance(v, bool)})
        return flat

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Timer:
    """Accumulates wall-clock seconds per name: `with timer("sampling"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


# JAX's own timings of what happens before a program first runs: tracing, lowering to MLIR, and
# the backend compile (a persistent compilation cache hit is timed there too: reading it back).
_COMPILE_EVENTS = frozenset(("/jax/core/compile/jaxpr_trace_duration",
                             "/jax/core/compile/jaxpr_to_mlir_module_duration",
                             "/jax/core/compile/backend_compile_duration"))
_compiles = {"seconds": 0.0, "watching": False}
_compiles_lock = threading.Lock()


def _on_duration(event: str, seconds: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        with _compiles_lock:
            _compiles["seconds"] += seconds


def watch_compiles() -> None:
    """Start adding up JAX's compile time in this process (idempotent; JAX listeners cannot be
    removed, so there is one for the process)."""
    with _compiles_lock:
        if _compiles["watching"]:
            return
        _compiles["watching"] = True
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compile_seconds() -> float:
    """Seconds JAX spent tracing, lowering and compiling (or reading from the persistent cache)
    since the first `watch_compiles`, summed over threads: a compile on a background thread
    (the engine's warm-up, the train step's precompile) overlaps other work."""
    return _compiles["seconds"]


@contextlib.contextmanager
def progress_bar(total: int, description: str, enabled: bool = True):
    """A rich progress bar; yields `advance(done, total)` (the rollout's progress callback)."""
    if not enabled:
        yield lambda done, total: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as prog:
        task = prog.add_task(description, total=total)
        yield lambda done, tot: prog.update(task, completed=done, total=tot)
