"""One RL iteration's rollout with every sandbox call executed against identical calls sharing
one execution (`Sandbox(memo_entries=...)`, `env/sandbox_memo.py`), side by side (HOST + DEVICE).

    PYTHONPATH=. python benchmarks/bench_sandbox_memo.py [--policy DIR] [--tasks 6] [--group 8] [--repeats 3]

The rollout is the study's RL iteration: `--tasks` tasks of its training pool
(`silent_bugs.rl_pool`, seed 0) x `--group` episodes, `collect_episodes` with the study's
tools (short style, 0.05 s per test), its engine rows and the default rollout settings, and
2 sandbox workers, sampling and sandbox sharing this machine's cores as in training. The
policy defaults to the shipped SFT policy (the start of RL); the shipped RL policy (its end)
repeats itself more. Each repeat runs both settings on the same tasks and seeds, the order
alternating; the memo starts empty in every repeat, so nothing carries over between rollouts.
Reports seconds per rollout and the ratio, the sandbox calls executed and shared, and
whether both settings produced the same episodes (token ids and rewards): the memo may
change the cost of a rollout, never its result, on tasks whose tests are deterministic.
Writes benchmarks/results/sandbox_memo.json.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench_results import machine, write_result
from experiments.binary_search_rl.config import StudyConfig
from experiments.binary_search_rl.silent_bugs import rl_pool
from experiments.binary_search_rl.stages import ENGINE_ROWS, rollout_config, tools_config
from jaxrl_agent.agent.policy import load_policy
from jaxrl_agent.agent.rollout import collect_episodes
from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.sandbox_memo import CallMemo
from jaxrl_agent.sampling.engine import SamplingEngine
from jaxrl_agent.sampling.engine_config import episode_engine
from jaxrl_agent.tokenizer import ChatFormat

SFT = "experiments/binary_search_rl/results/policies/sft"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default=SFT)
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sandbox_memo.json"))
    args = ap.parse_args()
    cfg = StudyConfig()
    model, tok = load_policy(args.policy)
    chat = ChatFormat(tok, tool_style=cfg.tool_style)
    rollout = rollout_config(cfg, group_size=args.group)
    engine = SamplingEngine(model, episode_engine(tok, rollout, batch_size=ENGINE_ROWS))
    tasks = rl_pool(cfg.rl.num_train_tasks, 0, cfg.rl.silent_bug_share, cfg.rl.canonical_like_share)[:args.tasks]
    tools = tools_config(cfg)
    seconds, calls, same = {"every_call": [], "memo": []}, [], []
    with Sandbox(num_workers=cfg.sandbox_workers) as sandbox:
        engine.warmup()
        collect_episodes(tasks[:1], engine, chat, sandbox, rollout_config(cfg, group_size=2), tools, seed=1)  # warm
        for rep in range(args.repeats):
            episodes = {}
            for name in (["every_call", "memo"] if rep % 2 == 0 else ["memo", "every_call"]):
                sandbox.memo = CallMemo() if name == "memo" else None  # empty: nothing from earlier rollouts
                t0 = time.perf_counter()
                episodes[name], _ = collect_episodes(tasks, engine, chat, sandbox, rollout, tools, seed=7 + rep)
                seconds[name].append(time.perf_counter() - t0)
                if name == "memo":
                    calls.append({"run": sandbox.memo.runs, "shared": sandbox.memo.hits})
            a, b = episodes["every_call"], episodes["memo"]
            same.append(len(a) == len(b) and all(x.ids == y.ids and x.reward == y.reward for x, y in zip(a, b)))
        sandbox.memo = None
    ratios = [e / m for e, m in zip(seconds["every_call"], seconds["memo"])]
    result = {
        "seconds_per_rollout": seconds, "speedup_memo": ratios, "speedup_range": [min(ratios), max(ratios)],
        "sandbox_calls": calls, "shared_share": [c["shared"] / (c["run"] + c["shared"]) for c in calls],
        "same_episodes": same,
        "setup": {"policy": args.policy, "tasks": args.tasks, "group": args.group, "repeats": args.repeats,
                  "engine_rows": ENGINE_ROWS, "sandbox_workers": cfg.sandbox_workers},
        "machine": machine(),
    }
    print(f"rollout of {args.tasks} tasks x {args.group} episodes ({args.policy}), {args.repeats} repeats")
    for name, s in seconds.items():
        print(f"{name:11s} s/rollout median {np.median(s):6.1f}  all {', '.join(f'{x:.1f}' for x in s)}")
    print(f"memo speed-up per repeat: {', '.join(f'{r:.2f}x' for r in ratios)}; sandbox calls shared "
          f"{', '.join(f'{x:.2f}' for x in result['shared_share'])}; same episodes: {all(same)}")
    write_result(args.out, result)


if __name__ == "__main__":
    reexec_with_tcmalloc()  # XLA:CPU's per-call scratch: see jaxrl_agent/cli/malloc_env.py
    main()
