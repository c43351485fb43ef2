"""Independent study stages side by side in worker processes (HOST).

    run_stages(jobs, [(name, fn, args, kwargs), ...], then={name: result -> [call, ...]})
      -> {name: fn(*args, **kwargs)} for the calls and the follow-ups `then` makes
      jobs == 1: in this process, in list order, each stage's follow-ups after the list
      jobs  > 1: in `jobs` spawned processes, the calls taken in list order as workers free up,
                 a stage's follow-ups queued behind them as soon as it finishes

Why: one stage leaves part of the two cores idle (the sampler's small kernels, the sandbox's
test processes, the host between steps), so two stages at once finish sooner than one after
the other (`benchmarks/bench_study_jobs.py` measures the study's RL stages both ways). Each
stage's result is the same either way: a stage reads only its inputs' files and writes only its
own directory (`stage_cache.py`), and its numbers do not depend on what runs beside it
(tests/test_study.py runs an RL stage in a worker, then again in the test's process).
A follow-up is a stage that needs another's result (an RL run's evaluation needs its policy):
queued in the same pool the moment that result exists, it fills the workers the last long
stages leave idle instead of waiting for a pool of its own.

A stage that fails does not stop the others: every call runs to its end (its result cached),
then the first failure is raised with its stage's name; a failed stage has no follow-ups.
Workers start fresh interpreters (spawn: a forked JAX runtime is unsafe), each with this
process's compilation-cache settings, and on Linux end when this process dies (`_die_with`).
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, Callable

Call = tuple[str, Callable[..., Any], tuple, dict]
FollowUp = Callable[[Any], list[Call]]


class StageError(RuntimeError):
    """A stage run in a worker failed; the message names it, `__cause__` is the worker's error."""


_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")
"""The persistent compilation cache's settings (`jaxrl_agent.cli.compile_cache.enable`), copied to workers."""


def _worker_init(options: dict[str, Any], parent: int) -> None:
    _die_with(parent)
    import jax

    for name, value in options.items():
        jax.config.update(name, value)


def _die_with(parent: int) -> None:
    """Linux: this worker gets SIGTERM when the process that started it dies. A stopped study
    (Ctrl-C twice, `kill`) otherwise leaves its busy workers running, orphaned, for the rest of
    their stage, writing into the work dir a rerun writes to. Elsewhere a no-op."""
    import ctypes
    import os
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call above: nobody will signal
        os._exit(1)


def run_stages(jobs: int, calls: list[Call], then: dict[str, FollowUp] | None = None) -> dict[str, Any]:
    """`{name: fn(*args, **kwargs)}` for each call and each follow-up, `jobs` at a time.

    Args:
      jobs: processes at once; 1 runs every call here, in order, and raises its error at once.
      calls: (stage name, a module-level function, args, kwargs), picklable for jobs > 1.
      then: stage name -> a function of that stage's result giving the calls that need it
        (run in this process; their stages may have follow-ups of their own).
    Returns:
      The results by name: the calls in list order, then their follow-ups (in their stages'
      order), then the follow-ups' follow-ups: the order jobs=1 runs them in.
    Raises:
      ValueError: jobs < 1 or two calls (follow-ups included) with one name.
      StageError: a worker's call failed (after all calls finished).
    """
    if jobs < 1:
        raise ValueError(f"jobs={jobs}: at least 1 (1 runs the stages one after another in this process)")
    then = then or {}
    # where each stage stands: calls (i,), their follow-ups (i, j), ...; sorted by (depth, path)
    # this is the order a first-in-first-out queue runs them in, whatever finished first
    path: dict[str, tuple[int, ...]] = {}

    def named(new: list[Call], parent: tuple[int, ...] = ()) -> list[Call]:
        for j, (name, *_) in enumerate(new):
            if name in path:
                raise ValueError(f"stage names must be unique, got {name!r} twice")
            path[name] = parent + (j,)
        return new

    queue = named(list(calls))
    if jobs == 1 or (len(queue) <= 1 and not then):
        done: dict[str, Any] = {}
        while queue:
            name, fn, args, kwargs = queue.pop(0)
            done[name] = fn(*args, **kwargs)
            queue += named(then[name](done[name]), path[name]) if name in then else []
        return done
    import jax

    cache = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
    futures: dict[str, Future] = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_worker_init, initargs=(cache, os.getpid())) as pool:
        running = {pool.submit(fn, *args, **kwargs): name for name, fn, args, kwargs in queue}
        futures |= {name: f for f, name in running.items()}
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                name = running.pop(f)
                if f.exception() is None and name in then:
                    for new_name, fn, args, kwargs in named(then[name](f.result()), path[name]):
                        futures[new_name] = pool.submit(fn, *args, **kwargs)
                        running[futures[new_name]] = new_name
    order = sorted(futures, key=lambda name: (len(path[name]), path[name]))
    for name in order:
        f = futures[name]
        if f.exception() is not None:
            raise StageError(f"stage {name!r} failed in a worker process: {f.exception()!r} (the other stages "
                             "finished and are cached; fix the cause and rerun, or rerun with --jobs=1 to "
                             "see its traceback in this process)") from f.exception()
    return {name: futures[name].result() for name in order}
