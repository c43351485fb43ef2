"""How much of the demo's first rollout is the rollout itself and how much is its first time
(programs compiled or read back, first calls): iteration 1's rollout, then the same tasks rolled
out again in the same process with the same seeds and a fresh sandbox memo (no tool result
reused), which samples the same episodes (checked) with everything loaded.

Not a comparison of two implementations: the figure `bench_startup.py`'s warm wait is read
against (the README's start-up row). The demo runs in this process on its defaults with the
given compilation cache (`--compile_cache`, as the CLI's flag: a directory a demo run filled
gives a warm start's first rollout; an empty one a cold start's); the run stops after the
second rollout. Also reported: JAX's compile seconds during each (a cache hit's read counts)
and the share of the machine's CPU time left idle during each (/proc/stat).

    python benchmarks/first_rollout_again.py --compile_cache=DIR [--out ...]
        -> benchmarks/results/first_rollout_again.json
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_results import machine, write_result  # noqa: E402


class _Done(Exception):
    """Raised out of the demo once both rollouts are measured."""


def _cpu_ticks() -> tuple[int, int]:
    """(idle + iowait, all) jiffies of the whole machine."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[3] + v[4], sum(v)


def _timed(fn, compile_seconds) -> tuple[object, dict]:
    i0, a0 = _cpu_ticks()
    c0, t0 = compile_seconds(), time.perf_counter()
    out = fn()
    t1, c1 = time.perf_counter(), compile_seconds()
    i1, a1 = _cpu_ticks()
    return out, {"s": round(t1 - t0, 2), "compile_s": round(c1 - c0, 2),
                 "idle_share": round((i1 - i0) / max(a1 - a0, 1), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile_cache", required=True, help="the persistent cache directory (as the CLI's flag)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "first_rollout_again.json"))
    args = ap.parse_args()
    from jaxrl_agent.cli.compile_cache import enable

    enable(args.compile_cache)
    import jaxrl_agent.loops.rl as rl
    from jaxrl_agent.cli.demo import DemoConfig, DemoRunConfig, run_demo_job
    from jaxrl_agent.env.sandbox_memo import CallMemo
    from jaxrl_agent.loops.metrics import compile_seconds, watch_compiles

    watch_compiles()
    real, result = rl.collect_share, {}

    def measured(procs, tasks, engine, chat, sandbox, cfg, tool_cfg, **kw):
        (first, _), result["first"] = _timed(lambda: real(procs, tasks, engine, chat, sandbox, cfg, tool_cfg, **kw),
                                             compile_seconds)
        if sandbox.memo is not None:
            sandbox.memo = CallMemo(sandbox.memo.max_entries)
        kw = {**kw, "progress": None, "on_episode": None}
        (again, _), result["again"] = _timed(lambda: real(procs, tasks, engine, chat, sandbox, cfg, tool_cfg, **kw),
                                             compile_seconds)
        result["episodes"] = len(first)
        result["same_episodes"] = [e.ids for e in first] == [e.ids for e in again]
        raise _Done

    rl.collect_share = measured
    with tempfile.TemporaryDirectory() as run_dir:
        try:
            run_demo_job(DemoRunConfig(DemoConfig(run_dir=run_dir)), show_progress=False)
        except _Done:
            pass
    if "again" not in result:
        raise RuntimeError("the demo ended before its first rollout (no RL run?)")
    result["first_time_s"] = round(result["first"]["s"] - result["again"]["s"], 2)
    write_result(args.out, {"config": vars(args), "machine": machine(malloc=os.environ.get("LD_PRELOAD", "default")),
                            **result})
    print(result)


if __name__ == "__main__":
    from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc

    reexec_with_tcmalloc()  # as the CLI runs (jaxrl_agent/cli/malloc_env.py)
    main()
