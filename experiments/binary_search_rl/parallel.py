"""Independent study stages side by side in worker processes (HOST).

    run_stages(jobs, [(name, fn, args, kwargs), ...]) -> {name: fn(*args, **kwargs)}
      jobs == 1: in this process, in list order
      jobs  > 1: in `jobs` spawned processes, the calls taken in list order as workers free up

Why: one stage leaves part of the two cores idle (the sampler's small kernels, the sandbox's
test processes, the host between steps), so two stages at once finish sooner than one after
the other (`benchmarks/bench_study_jobs.py` measures the study's RL stages both ways). Each
stage's result is the same either way: a stage reads only its inputs' files and writes only its
own directory (`stage_cache.py`), and its numbers do not depend on what runs beside it
(tests/test_study.py runs an RL stage in a worker, then again in the test's process).

A stage that fails does not stop the others: every call runs to its end (its result cached),
then the first failure is raised with its stage's name. Workers start fresh interpreters
(spawn: a forked JAX runtime is unsafe), each with this process's compilation-cache settings.
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor, wait
from typing import Any, Callable

Call = tuple[str, Callable[..., Any], tuple, dict]


class StageError(RuntimeError):
    """A stage run in a worker failed; the message names it, `__cause__` is the worker's error."""


_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")
"""The persistent compilation cache's settings (`jaxrl_agent.compile_cache.enable`), copied to workers."""


def _worker_init(options: dict[str, Any]) -> None:
    import jax

    for name, value in options.items():
        jax.config.update(name, value)


def run_stages(jobs: int, calls: list[Call]) -> dict[str, Any]:
    """`{name: fn(*args, **kwargs)}` for each call, `jobs` at a time.

    Args:
      jobs: processes at once; 1 runs every call here, in order, and raises its error at once.
      calls: (stage name, a module-level function, args, kwargs), picklable for jobs > 1.
    Raises:
      ValueError: jobs < 1 or two calls with one name.
      StageError: a worker's call failed (after all calls finished).
    """
    if jobs < 1:
        raise ValueError(f"jobs={jobs}: at least 1 (1 runs the stages one after another in this process)")
    names = [c[0] for c in calls]
    if len(set(names)) != len(names):
        raise ValueError(f"stage names must be unique, got {names}")
    if jobs == 1 or len(calls) <= 1:
        return {name: fn(*args, **kwargs) for name, fn, args, kwargs in calls}
    import jax

    cache = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
    with ProcessPoolExecutor(max_workers=min(jobs, len(calls)), mp_context=multiprocessing.get_context("spawn"),
                             initializer=_worker_init, initargs=(cache,)) as pool:
        futures = {name: pool.submit(fn, *args, **kwargs) for name, fn, args, kwargs in calls}
        wait(futures.values())
    for name, f in futures.items():
        if f.exception() is not None:
            raise StageError(f"stage {name!r} failed in a worker process: {f.exception()!r} (the other stages "
                             "finished and are cached; fix the cause and rerun, or rerun with --jobs=1 to "
                             "see its traceback in this process)") from f.exception()
    return {name: f.result() for name, f in futures.items()}
