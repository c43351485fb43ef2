"""Sandbox pool vs naive `subprocess.run([python, -m, pytest, ...])` for `run_tests` (HOST).

64 concurrent episodes (generated tasks, each a private workspace with its dev tests) call
`run_tests` at once, twice over:
- pool: `Sandbox.run(ws, [python, -m, pytest, -q, <dev tests>])` (jail, uid drop, rlimits,
  in-process pytest in a forked child of a warm worker);
- naive: what a user would otherwise write: copy the workspace, then
  `subprocess.run([python, -m, pytest, -q, <dev tests>], timeout=...)` with the same rlimits
  (CPU, address space, file size, open files), its own session and the same environment
  variables (no pytest plugin autoload); no jail, no uid drop.
Both get the same number of concurrent slots (the pool's worker count). Throughput is
calls per second over the whole batch; `speedup_vs_naive` is the ratio.

Overhead: sequential calls through an idle pool; per call, the caller-observed latency
minus the child's own wall time (`RunResult.duration_s`: fork to exit, which includes the
whole pytest session) = copy + IPC + fork + cleanup. Reported at p50/p99.

Judge cost: the hidden tests of each task on its reference solution, one call at a time,
both ways in one run, interleaved: `Sandbox.judge` (what `verify` does: tests and comparisons
in the judge process, the code served as plain data by the jailed child) against the same
tests run in-process in the child (`Sandbox.run(..., memory_files=...)`, what `verify` did
before the judge existed). `judge_cost_ratio` = judge seconds / in-process seconds.

Run: `python benchmarks/bench_sandbox.py` (writes benchmarks/results/sandbox.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import generate_tasks
from jaxrl_agent.env.tools import create_workspaces


# ---- the two ways to run the dev tests ----

# The same environment the pool's children get: in particular no third-party pytest plugin
# autoload (in this dev environment, hypothesis' plugin alone costs ~0.8 s per start).
NAIVE_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
             "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
             "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def naive_run(ws: str, files: list[str], timeout_s: float, memory_mb: int) -> float:
    """Copy + subprocess.run with the same rlimits; returns wall seconds."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        copy = shutil.copytree(ws, os.path.join(tmp, "ws"))

        def limits():
            os.setsid()
            for which, value in [(resource.RLIMIT_CPU, int(timeout_s) + 1),
                                 (resource.RLIMIT_AS, memory_mb << 20),
                                 (resource.RLIMIT_FSIZE, 16 << 20),
                                 (resource.RLIMIT_NOFILE, 256)]:
                resource.setrlimit(which, (value, value))

        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *files], cwd=copy, capture_output=True, timeout=timeout_s,
                           preexec_fn=limits, env=NAIVE_ENV)
        assert r.returncode == 0, r.stdout.decode()[-500:]
    return time.perf_counter() - t0


def pool_run(sb: Sandbox, ws: str, files: list[str]) -> tuple[float, float]:
    """One call through the pool; returns (latency, child wall time)."""
    t0 = time.perf_counter()
    r = sb.run(ws, [sys.executable, "-m", "pytest", "-q", *files])
    latency = time.perf_counter() - t0
    assert r.error is None and r.returncode == 0, (r.error, r.stdout[-500:])
    return latency, r.duration_s


def judge_cost(sb: Sandbox, tasks, root: str, rounds: int = 3) -> dict:
    """Seconds per hidden-test run: judge vs in-process, interleaved task by task."""
    from jaxrl_agent.env.judge import module_names
    from jaxrl_agent.env.verifier import pytest_args

    times = {"judge": [], "in_process": []}
    for r in range(rounds):
        for i, t in enumerate(tasks):
            ws = create_workspaces(dict(t.reference_files), os.path.join(root, f"j{r}-{i}"), 1)[0]
            args = pytest_args(sorted(t.hidden_tests))
            order = [("judge", "in_process"), ("in_process", "judge")][(r + i) % 2]
            for way in order:
                t0 = time.perf_counter()
                if way == "judge":
                    res = sb.judge(ws, args, dict(t.hidden_tests), module_names(t.files))
                else:
                    res = sb.run(ws, [sys.executable, "-m", "pytest", *args],
                                 memory_files=dict(t.hidden_tests), test_timeout_s=1.0)
                times[way].append(time.perf_counter() - t0)
                assert res.error is None and res.returncode == 0, (way, res.error, res.stdout[-300:])
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"judge_ms_p50": med["judge"] * 1e3, "in_process_ms_p50": med["in_process"] * 1e3,
            "judge_cost_ratio": med["judge"] / med["in_process"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--workers", type=int, default=2 * (os.cpu_count() or 1))
    p.add_argument("--overhead-calls", type=int, default=200)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--memory-mb", type=int, default=1024)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "sandbox.json"))
    args = p.parse_args()

    # ---- 64 episodes: fixed code + dev tests (the tests pass: we time the machinery) ----
    tasks = generate_tasks("train", args.episodes, 0)
    root = tempfile.mkdtemp(prefix="bench-sandbox-")
    eps = []
    for i, t in enumerate(tasks):
        ws = create_workspaces({**t.reference_files, **t.dev_tests},
                               os.path.join(root, str(i)), 1)[0]
        eps.append((ws, sorted(t.dev_tests)))

    with Sandbox(num_workers=args.workers, timeout_s=args.timeout,
                 memory_mb=args.memory_mb) as sb:
        for ws, files in eps[: args.workers * 2]:  # warm-up (page cache, lazy imports)
            pool_run(sb, ws, files)
        # ---- throughput: all episodes at once ----
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.episodes) as ex:
            list(ex.map(lambda e: pool_run(sb, *e), eps))
        pool_s = time.perf_counter() - t0
        # ---- overhead: one call at a time ----
        over = []
        for k in range(args.overhead_calls):
            lat, child = pool_run(sb, *eps[k % len(eps)])
            over.append((lat - child) * 1e3)
        judged = judge_cost(sb, tasks[:16], root)
        isolation = sb.isolation

    naive_run(*eps[0], args.timeout, args.memory_mb)  # warm-up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as ex:  # same number of concurrent slots
        naive_lat = list(ex.map(lambda e: naive_run(*e, args.timeout, args.memory_mb), eps))
    naive_s = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)

    over = np.array(over)
    res = dict(
        speedup_vs_naive=float(naive_s / pool_s),
        p99_overhead_ms=float(np.percentile(over, 99)),
        p50_overhead_ms=float(np.percentile(over, 50)),
        pool_calls_per_s=float(args.episodes / pool_s),
        naive_calls_per_s=float(args.episodes / naive_s),
        naive_p50_latency_ms=float(np.percentile(naive_lat, 50) * 1e3),
        **judged,
        episodes=args.episodes, workers=args.workers, isolation=isolation,
        cpu_count=os.cpu_count(), python=platform.python_version(), machine=platform.machine())
    print(f"{'':24}{'pool':>12}{'naive':>12}")
    print(f"{'calls/s (64 concurrent)':24}{res['pool_calls_per_s']:>12.1f}"
          f"{res['naive_calls_per_s']:>12.1f}")
    print(f"{'speedup':24}{res['speedup_vs_naive']:>12.2f}x")
    print(f"{'overhead p50 / p99 ms':24}{res['p50_overhead_ms']:>6.1f} / {res['p99_overhead_ms']:.1f}")
    print(f"{'verify: judge / in-process ms':24} {res['judge_ms_p50']:.1f} / {res['in_process_ms_p50']:.1f}"
          f"  ({res['judge_cost_ratio']:.2f}x)")
    print(f"(workers={args.workers}, isolation={isolation}, cpus={os.cpu_count()})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
