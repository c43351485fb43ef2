"""A change to start-up against the code before it: the demo's wait for its first iteration on
a warm start (and a cold one), two git revisions side by side, interleaved round by round.

`bench_startup.py` measures one checkout's cold and warm starts; a change to what a warm start
does (what it loads ahead, what runs beside the first rollout) moves the wait by a second or so
on a ~20 s wait, under the machine's drift between sessions. Here both sides run in the same
session: each checkout (the working tree, and `--base` in a temporary git worktree) gets its own
compilation cache and program store, filled by one cold run of its own; then warm runs alternate
A B, B A, ... so drift falls on both. Each run is `python -m jaxrl_agent demo` launched from that
checkout (its package first on the path), stopped at its first `iter   1` line
(`bench_startup.time_to_first_iteration`).

    python benchmarks/ab_startup.py --base HEAD~1 [--repeats=3]   -> benchmarks/results/ab_startup.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile

from bench_results import machine, write_result
from bench_startup import HERE, ROOT, time_to_first_iteration


def _revision(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD~1", help="git revision to compare the working tree against")
    ap.add_argument("--repeats", type=int, default=3, help="warm runs per side")
    ap.add_argument("--limit_s", type=float, default=900)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ab_startup.json"))
    args, extra = ap.parse_known_args()  # anything else goes to the demo (e.g. --demo.eval_tasks=8)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.strip()
    names = {"base": f"{args.base} ({_revision(args.base)})",
             "head": f"working tree on {_revision('HEAD')}" + (" (uncommitted changes)" if dirty else "")}
    runs: dict[str, dict] = {side: {"cold": None, "warm": []} for side in names}
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"base": os.path.join(tmp, "base"), "head": ROOT}
        subprocess.run(["git", "worktree", "add", "--detach", roots["base"], args.base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            def run(side: str, kind: str, n: int) -> dict:
                res = time_to_first_iteration(os.path.join(tmp, f"cache_{side}"),
                                              os.path.join(tmp, f"run_{side}_{kind}{n}"), extra, args.limit_s,
                                              root=roots[side])
                print(f"{side} ({names[side]}) {kind}: first iteration after {res['first_iteration_s']:.1f} s",
                      flush=True)
                return res
            for side in names:
                runs[side]["cold"] = run(side, "cold", 0)
            for r in range(args.repeats):  # A B, B A, ...: a drift of the machine falls on both sides
                for side in (("base", "head") if r % 2 == 0 else ("head", "base")):
                    runs[side]["warm"].append(run(side, "warm", r))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", roots["base"]], cwd=ROOT, capture_output=True)
    warm = {side: [x["first_iteration_s"] for x in runs[side]["warm"]] for side in names}
    cold = {side: runs[side]["cold"]["first_iteration_s"] for side in names}
    summary = {side: {"revision": names[side], "cold_s": cold[side], "warm_s": warm[side],
                      "warm_median_s": statistics.median(warm[side]),
                      "speedup_vs_own_cold": round(cold[side] / statistics.median(warm[side]), 2)}
               for side in names}
    summary["warm_head_over_base"] = round(summary["head"]["warm_median_s"] / summary["base"]["warm_median_s"], 3)
    write_result(args.out, {"config": {**vars(args), "demo_overrides": extra}, "machine": machine(),
                            "summary": summary, "runs": runs})
    print(summary)


if __name__ == "__main__":
    main()
