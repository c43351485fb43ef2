"""Soak: memory and open files over many RL iterations on a tiny policy (issue 7 reliability).

    python benchmarks/soak_rl.py [--iterations 200]

Runs the real loop (`rl.train_rl`: sampling engine, sandbox, verifier, train step) on the
one-step tool-choice task of tests/test_rl.py, records the process RSS and its open file
descriptors after every iteration, and writes benchmarks/results/soak.json with the first /
last values and the least-squares slope over the second half (after warm-up and compilation).
Flat means: slopes near 0 and no growth in file descriptors.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak.json"))
    args = ap.parse_args()

    from test_rl import ROLLOUT, SAMPLING, TASKS, TOOLS, TRAJ, rl_config, sft_model

    from jaxrl_agent.config import OptimConfig, TrainConfig
    from jaxrl_agent.loops.rl import train_rl
    from jaxrl_agent.tokenizer import load_tokenizer

    tok = load_tokenizer()
    model = sft_model.__wrapped__(tok)  # the tests' fixture body: a short SFT on 50/50 demos
    samples = []
    t0 = time.perf_counter()

    def record(it, metrics):
        samples.append((it, rss_mb(), open_fds(), metrics.get("rollout/success", float("nan"))))
        if it % 20 == 0:
            print(f"iter {it:4d}  rss {samples[-1][1]:8.1f} MB  fds {samples[-1][2]:4d}  success {samples[-1][3]:.2f}"
                  f"  ({time.perf_counter() - t0:.0f}s)")
            write(summarize())  # a run stopped early still leaves its figures

    def summarize() -> dict:
        its, rss, fds, _ = map(np.array, zip(*samples))
        half = len(its) // 2
        slope = lambda y: float(np.polyfit(its[half:], y[half:], 1)[0])  # noqa: E731 - per iteration
        return {
            "iterations": int(its[-1]), "seconds": time.perf_counter() - t0,
            "rss_mb_first": float(rss[0]), "rss_mb_last": float(rss[-1]), "rss_mb_max": float(rss.max()),
            "rss_mb_per_iteration_second_half": slope(rss),
            "fds_first": int(fds[0]), "fds_last": int(fds[-1]), "fds_max": int(fds.max()),
            "fds_per_iteration_second_half": slope(fds.astype(float)),
        }

    def write(result: dict) -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as d:
        cfg = rl_config(Path(d), iterations=args.iterations, tasks_per_iter=2, checkpoint_every=50)
        train_rl(model, tok, rl=cfg, rollout=ROLLOUT, sampling=SAMPLING, train=TrainConfig(),
                 optim=OptimConfig(learning_rate=3e-4), tools=TOOLS, traj=TRAJ, train_tasks=TASKS,
                 eval_tasks=TASKS[:1], show_progress=False, on_iteration=record)
    result = summarize()
    print(json.dumps(result, indent=2))
    write(result)


if __name__ == "__main__":
    main()
