"""The verifier's per-test CPU limit in one RL iteration's rollout of the study, side by side:
the default (1 s, `verifier.TEST_TIMEOUT_S`) against the study's (`StudyConfig.test_timeout_s`)
(HOST + DEVICE).

    PYTHONPATH=. python benchmarks/bench_verify_limit.py [--iterations 2] [--repeats 2]

A rollout is `collect_episodes` on one RL iteration of the study's training pool
(`silent_bugs.rl_pool` at the study's shares: a third of it is the canonical task's kind,
whose `hi = mid` bug loops on an absent value) x the study's group, with the study's SFT
policy (the RL start, `experiments/binary_search_rl/results/policies/sft`), its engine rows,
its tool limit and its 2 sandbox workers. A submission that still loops costs the verifier
the whole limit (it stops at the first failing test); sampling, tools and verification share
the machine's cores, so the limit is paid in rollout seconds. Settings alternate repeat by
repeat on the same tasks and seeds; rewards must agree (a lower limit is only stricter, and
a correct solution of this family runs a test in microseconds): the script says if they do
not. Writes benchmarks/results/verify_limit.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np

from experiments.binary_search_rl.config import StudyConfig
from experiments.binary_search_rl.silent_bugs import rl_pool
from experiments.binary_search_rl.stages import ENGINE_ROWS, chat_format, rollout_config, tools_config
from jaxrl_agent.agent.policy import load_policy
from jaxrl_agent.agent.rollout import collect_episodes
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.verifier import TEST_TIMEOUT_S
from jaxrl_agent.sampling.engine import SamplingEngine
from jaxrl_agent.sampling.engine_config import episode_engine

SFT_POLICY = Path(__file__).parents[1] / "experiments/binary_search_rl/results/policies/sft"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=2, help="RL iterations' tasks per rollout")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--policy", default=str(SFT_POLICY))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "verify_limit.json"))
    args = ap.parse_args()
    cfg = StudyConfig()
    r = cfg.rl
    tasks = rl_pool(r.num_train_tasks, cfg.seed, r.silent_bug_share, r.canonical_like_share)
    tasks = tasks[:r.tasks_per_iter * args.iterations]
    settings = {f"verify_limit_{TEST_TIMEOUT_S:g}s": TEST_TIMEOUT_S,
                f"verify_limit_{cfg.test_timeout_s:g}s": cfg.test_timeout_s}
    model, tok = load_policy(args.policy)
    chat = chat_format(cfg, tok)
    rollout = rollout_config(cfg, group_size=r.group_size)
    engine = SamplingEngine(model, episode_engine(tok, rollout, batch_size=ENGINE_ROWS, seed=0))
    seconds = {name: [] for name in settings}
    parts = {name: [] for name in settings}
    rewards = {name: [] for name in settings}
    with Sandbox(num_workers=cfg.sandbox_workers) as sandbox:
        engine.warmup()
        collect_episodes(tasks[:1], engine, chat, sandbox, replace(rollout, group_size=2), tools_config(cfg), seed=1)
        for rep in range(args.repeats):
            names = list(settings) if rep % 2 == 0 else list(settings)[::-1]
            for name in names:
                t0 = time.perf_counter()
                eps, stats = collect_episodes(tasks, engine, chat, sandbox,
                                              replace(rollout, verify_test_timeout_s=settings[name]),
                                              tools_config(cfg), seed=7)
                seconds[name].append(time.perf_counter() - t0)
                rewards[name].append([e.reward for e in eps])
                parts[name].append({"sampling_s": stats.seconds_sampling, "tools_s_summed": stats.seconds_tools,
                                    "verify_s_summed": stats.seconds_verify, "episodes": stats.episodes,
                                    "success": float(np.mean([e.reward for e in eps]))})
    med = {k: float(np.median(v)) for k, v in seconds.items()}
    default, study = settings
    agree = [a == b for a, b in zip(rewards[default], rewards[study])]
    result = {
        "median_seconds": med, "all_seconds": seconds, "speedup_study_limit": med[default] / med[study],
        "rewards_agree_per_repeat": agree, "parts": parts,
        "setup": {"rl_iterations": args.iterations, "tasks": len(tasks), "group": r.group_size,
                  "episodes": len(tasks) * r.group_size, "repeats": args.repeats, "policy": args.policy,
                  "sandbox_workers": cfg.sandbox_workers, "engine_rows": ENGINE_ROWS,
                  "canonical_like_tasks": sum(t.task_id.startswith("canonical-like") for t in tasks)},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__},
    }
    print(f"rollout of {len(tasks)} study pool tasks x {r.group_size} episodes (study SFT policy)")
    print(f"{'setting':22s} {'median s':>9s} {'verify s (summed)':>18s} {'success':>8s}")
    for name in settings:
        p = parts[name][-1]
        print(f"{name:22s} {med[name]:9.1f} {p['verify_s_summed']:18.1f} {p['success']:8.2f}")
    print(f"study limit: {result['speedup_study_limit']:.2f}x faster; rewards agree per repeat: {agree}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
