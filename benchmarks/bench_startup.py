"""The wait before the first RL iteration of `python -m jaxrl_agent demo`, with JAX's persistent
compilation cache cold (a fresh directory) against warm (the directory the cold run filled),
and with the cache off, side by side on this machine.

Each run is a fresh `python -m jaxrl_agent demo` process (the README's main command, its
defaults, a scratch run directory). The clock starts at the process launch and stops when it
prints its first `iter   1` line (or its "no RL run" verdict on a policy RL cannot train: the
same evaluations and compiles, minus the update); the process is then stopped. Each run's
`split` says how much of that wait was iteration 1's own rollout and update (from the run's
metrics.jsonl) and how much the rest: start-up, compiles, checks, evaluations before training, and
how many of those seconds JAX spent compiling (`time/compile`, any thread; a cache hit's read
counts). The warm wait less those seconds is what no cache can go under. Runs go in rounds of
off -> cold -> warm (the warm run reuses the directory its round's cold run filled), `--repeats`
rounds.

    python benchmarks/bench_startup.py [--repeats=2]   -> benchmarks/results/startup.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIRST_ITERATION = re.compile(r"^iter\s+1\s")
NO_SIGNAL = "no RL run:"  # the demo's verdict on a policy with no signal: its pre-training work is done


def time_to_first_iteration(cache: str, run_dir: str, extra: list[str], limit_s: float, root: str = ROOT) -> dict:
    """Launch the demo with `--compile_cache=cache` from the checkout at `root` (its package
    first on the path: `python -m` puts the working directory there); seconds until its first
    iteration line, and when each earlier line appeared."""
    cmd = [sys.executable, "-m", "jaxrl_agent", "demo", f"--compile_cache={cache}", f"--demo.run_dir={run_dir}",
           *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, first, stop = [], None, None
    try:
        for line in proc.stdout:
            t = time.perf_counter() - t0
            lines.append((round(t, 2), line.rstrip()[:100]))
            if FIRST_ITERATION.match(line) or NO_SIGNAL in line:
                first = t
                stop = "first_iteration" if FIRST_ITERATION.match(line) else "no_signal_verdict"
                break
            if t > limit_s:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if first is None:
        tail = "\n".join(text for _, text in lines[-15:])
        raise RuntimeError(f"no first iteration within {limit_s} s ({cmd}):\n{tail}")
    return {"first_iteration_s": round(first, 2), "stopped_at": stop, "split": _split(run_dir, first),
            "milestones": [m for m in lines if not m[1].startswith("config")]}


def _split(run_dir: str, first: float) -> dict:
    """Where the wait went, from the run's own metrics.jsonl (line-buffered, so the killed run
    wrote it): iteration 1's rollout (its 48 episodes, which are also the probe), reward and
    update seconds, and the rest (start-up, compiles, checks, evaluations before training)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    recs = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
    it1 = next((r for r in recs if r["step"] == 1 and "time/rollout" in r), None)
    if it1 is None:  # the no-signal verdict: no iteration ran
        return {}
    parts = {k: round(it1.get(f"time/{k}", 0.0), 2) for k in ("rollout", "reward", "train")}
    out = {**parts, "rest": round(first - sum(parts.values()), 2)}
    if "time/compile" in it1:  # JAX's tracing, lowering and compiles (or cache reads) by then, any thread:
        # they lie across the parts above (and overlap them where a thread compiles in the background)
        out["compile"] = round(it1["time/compile"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--limit_s", type=float, default=900)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "startup.json"))
    args, extra = ap.parse_known_args()  # anything else goes to the demo (e.g. --demo.eval_tasks=8)
    runs: dict[str, list] = {"off": [], "cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            cache = os.path.join(tmp, f"cache{r}")
            for mode, setting in (("off", "off"), ("cold", cache), ("warm", cache)):
                res = time_to_first_iteration(setting, os.path.join(tmp, f"run_{mode}{r}"), extra, args.limit_s)
                runs[mode].append(res)
                print(f"round {r + 1}: {mode:4s} first iteration after {res['first_iteration_s']:.1f} s", flush=True)
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs)
            runs["cold"][-1]["cache_bytes"] = size
    firsts = {m: [x["first_iteration_s"] for x in v] for m, v in runs.items()}
    summary = {m: {"first_iteration_s": v, "split": [x["split"] for x in runs[m]]} for m, v in firsts.items()}
    summary["warm"]["speedup_vs_cold"] = [round(c / w, 2) for c, w in zip(firsts["cold"], firsts["warm"])]
    # The 3x target against what a warm run would wait if every compile cost nothing (no trace, no
    # lowering, no cache read): the wait less its compile seconds, a floor for any cache
    summary["warm"]["target_3x_s"] = [round(c / 3, 2) for c in firsts["cold"]]
    summary["warm"]["without_compiles_s"] = [round(x["first_iteration_s"] - x["split"]["compile"], 2)
                                             for x in runs["warm"] if "compile" in x["split"]]
    summary["cold"]["vs_off"] = [round(o / c, 2) for o, c in zip(firsts["off"], firsts["cold"])]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {**vars(args), "demo_overrides": extra}, "cpus": os.cpu_count(), "summary": summary,
                   "runs": runs}, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
