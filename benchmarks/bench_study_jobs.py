"""The study's RL stages one after another against two at a time (`StudyConfig.jobs`)
(HOST + DEVICE).

    PYTHONPATH=. python benchmarks/bench_study_jobs.py [--seeds 0 1] [--iterations 2] [--repeats 2]

The stages are the study's GRPO run and its shuffled-reward control for each seed, from the
shipped SFT policy, cut to `--iterations` iterations (the learning curve at the start and the
end, as the study's `eval_every` does), each with its 2 sandbox workers. "serial" runs them
with `parallel.run_stages(1, ...)` in this process, as `--jobs=1` does; "jobs_2" with
`run_stages(2, ...)`: two spawned processes, each taking stages as it frees up, as the study's
default does. A worker pays its imports and its first traces once, so with two seeds each
worker runs two stages, as in the study (whose pool runs eight). Settings alternate repeat by
repeat, each in a fresh work directory; a warm-up run fills the persistent compilation cache
first, so both read compiled programs from it (serial also keeps them traced in this process
from the warm-up on, which favours it: each worker traces them once). The training rewards of each stage must be the same in both settings (a
stage's numbers do not depend on what runs beside it): the script says if they are not.
Writes benchmarks/results/study_jobs.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np

from experiments.binary_search_rl import stages
from experiments.binary_search_rl.config import StudyConfig
from experiments.binary_search_rl.parallel import run_stages
from jaxrl_agent.cli.compile_cache import enable as enable_compile_cache

SFT_POLICY = Path(__file__).parents[1] / "experiments/binary_search_rl/results/policies/sft"
RUNS = {"rl": False, "control": True}  # stage name -> shuffled rewards


def calls(cfg: StudyConfig, policy: str, seeds: list[int]) -> list:
    return [(f"{name}_seed{seed}", stages.rl, (cfg, f"{name}_seed{seed}", {"policy": policy}),
             {"shuffle_rewards": shuffle, "seed": seed}) for seed in seeds for name, shuffle in RUNS.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="an RL run and its control per seed")
    ap.add_argument("--iterations", type=int, default=2, help="RL iterations per stage")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--policy", default=str(SFT_POLICY))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "study_jobs.json"))
    args = ap.parse_args()
    enable_compile_cache(None)  # as the study does; workers copy its settings
    scratch = Path(tempfile.mkdtemp(prefix="bench_study_jobs_"))
    base = StudyConfig()

    def config(tag: str, iterations: int) -> StudyConfig:
        rl = replace(base.rl, iterations=iterations, eval_every=iterations)
        return replace(base, rl=rl, work_dir=str(scratch / tag))

    # ---- warm-up: every program the stages compile, into the persistent cache ----
    run_stages(1, calls(config("warmup", 1), args.policy, args.seeds[:1])[:1])
    settings = {"serial": 1, "jobs_2": 2}
    seconds = {k: [] for k in settings}
    rewards = {k: [] for k in settings}
    for rep in range(args.repeats):
        for name in (list(settings) if rep % 2 == 0 else list(settings)[::-1]):
            cfg = config(f"{name}_{rep}", args.iterations)
            t0 = time.perf_counter()
            done = run_stages(settings[name], calls(cfg, args.policy, args.seeds))
            seconds[name].append(time.perf_counter() - t0)
            rewards[name].append({k: [it["reward"] for it in v["train_reward"]] for k, v in done.items()})
            print(f"[{name} repeat {rep}] {seconds[name][-1]:.1f} s", flush=True)
            shutil.rmtree(cfg.work_dir, ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)
    agree = [a == b for a, b in zip(rewards["serial"], rewards["jobs_2"])]
    ratios = [s / p for s, p in zip(seconds["serial"], seconds["jobs_2"])]
    result = {
        "seconds": seconds, "serial_over_jobs_2": ratios, "median_ratio": float(np.median(ratios)),
        "train_rewards_agree_per_repeat": agree, "train_rewards": rewards,
        "setup": {"stages": [c[0] for c in calls(base, args.policy, args.seeds)], "iterations": args.iterations, "repeats": args.repeats,
                  "policy": args.policy, "episodes_per_iteration": base.rl.tasks_per_iter * base.rl.group_size,
                  "sandbox_workers_per_stage": base.sandbox_workers},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__},
    }
    print(f"{2 * len(args.seeds)} study RL stages of {args.iterations} iterations: serial {seconds['serial']} s, "
          f"2 jobs {seconds['jobs_2']} s -> {', '.join(f'{r:.2f}x' for r in ratios)}; "
          f"training rewards agree per repeat: {agree}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
