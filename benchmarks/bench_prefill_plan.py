"""A flush's prefill calls planned for the least padded work, against one call per length
bucket on at least B/4 rows (the former plan), side by side (DEVICE + HOST).

    python benchmarks/bench_prefill_plan.py [--repeats 3] [--reps 9]

Two parts, on the agent engine (`agent_sampling`: 16 rows, S = 1024, the shipped demo policy):
- `fit`: one prefill call timed per shape (rows R in 1, 4, 16 x length T in 64, 128, 256,
  median of --reps) and the least-squares fit `ms = c0 + R * (c1 + c2 * T)`, in slots of T
  a row's own fixed cost `c1 / c2` and a call's `c0 / c2` (`prefill_plan.CALL_SLOTS`: the cost
  model the plan minimises, `R * T + CALL_SLOTS`, comes from this fit);
- `rollout`: the multi-turn agent benchmark's rollout (bench_vs_trl_agent.py at its `study`
  settings: 6 tasks x 8 episodes, tools, memoised sandbox emptied per rollout), alternating
  the two plans rollout by rollout: seconds, prefill slots (rows x length of every call) and
  whether both give the same episodes (they must: a row's tokens depend on its seed and
  contents only).
Writes benchmarks/results/prefill_plan.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import bench_vs_trl_agent as agent_bench  # noqa: E402
from bench_results import machine, write_result  # noqa: E402

from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc  # noqa: E402
from jaxrl_agent.sampling.prefill_plan import PrefillCall  # noqa: E402


def former_plan(engine):
    """The former flush: one call per length bucket in use, on its rows, padded to the smallest
    row bucket (then ceil(B/4), ceil(B/2), B) that holds them."""
    def plan(staged: dict[int, int]) -> list[PrefillCall]:
        by_len: dict[int, list[int]] = {}
        for b, n in sorted(staged.items()):
            if n > 0:
                by_len.setdefault(next(t for t in engine.buckets if t >= n), []).append(b)
        return [PrefillCall(rows=tuple(rows), num_rows=next(r for r in engine.row_buckets if r >= len(rows)), length=t)
                for t, rows in sorted(by_len.items())]
    return plan


def fit_costs(engine, reps: int) -> dict:
    """Time one prefill per (R, T) and fit ms = c0 + R * (c1 + c2 * T)."""
    times = {}
    for r in (1, 4, 16):
        for t in (64, 128, 256):
            rows = np.arange(r, dtype=np.int32)
            tokens = valid = np.ones((r, t), np.int32)
            ms = []
            for i in range(reps + 2):
                lengths = np.asarray(engine.cache.lengths)
                reset = lengths[rows] + t > engine.config.cache_size  # a full row starts over
                t0 = time.perf_counter()
                engine.cache, engine.logits = engine._prefill_fn(engine.state, engine.cache, engine.logits, rows,
                                                                 tokens, valid, reset)
                jax.block_until_ready(engine.logits)
                if i >= 2:  # the first two: compile, then warm
                    ms.append(1000 * (time.perf_counter() - t0))
            times[(r, t)] = float(np.median(ms))
    a = np.array([[1.0, r, r * t] for r, t in times])
    c0, c1, c2 = np.linalg.lstsq(a, np.array(list(times.values())), rcond=None)[0]
    return {"ms": {f"{r}x{t}": v for (r, t), v in times.items()}, "c0_ms": float(c0), "c1_ms": float(c1),
            "c2_ms": float(c2), "row_slots": float(c1 / c2), "call_slots": float(c0 / c2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default=agent_bench.single.POLICY)
    ap.add_argument("--repeats", type=int, default=3, help="rollouts per plan")
    ap.add_argument("--reps", type=int, default=9, help="timed prefill calls per shape")
    ap.add_argument("--out", default=str(HERE / "results" / "prefill_plan.json"))
    args = ap.parse_args()
    from dataclasses import replace

    from jaxrl_agent.agent.policy import load_policy
    from jaxrl_agent.config import RolloutConfig
    from jaxrl_agent.env.sandbox import Sandbox
    from jaxrl_agent.env.sandbox_memo import MEMO_ENTRIES
    from jaxrl_agent.sampling.engine import SamplingEngine
    from jaxrl_agent.sampling.engine_config import episode_engine

    model, tok = load_policy(args.policy)
    sampling = episode_engine(tok, RolloutConfig(max_total_tokens=agent_bench.MAX_TOTAL))
    b = sampling.batch_size
    engines = {"planned": SamplingEngine(model, sampling),
               # the former row buckets too: ceil(B/4), ceil(B/2), B
               "former": SamplingEngine(model, replace(sampling, prefill_row_buckets=(-(-b // 4), -(-b // 2), b)))}
    engines["former"]._plan = former_plan(engines["former"])
    fit = fit_costs(SamplingEngine(model, sampling), args.reps)  # its own engine: it fills rows with junk
    print(f"fit: {fit['c0_ms']:.2f} ms + R x ({fit['c1_ms']:.2f} ms + {fit['c2_ms'] * 1000:.1f} us x T): "
          f"a row's own cost ~ {fit['row_slots']:.0f} slots, a call's ~ {fit['call_slots']:.0f} (CALL_SLOTS)")
    seconds = {k: [] for k in engines}
    slots = {k: [] for k in engines}
    same = []
    with Sandbox(num_workers=2, memo_entries=MEMO_ENTRIES) as sandbox:
        agent = agent_bench.Agent(args.policy, 6, "study")
        for name, eng in engines.items():  # compile every shape, warm the sandbox
            eng.warmup()
            agent.rollout(agent.tasks[:1], eng, sandbox, 2, seed=1)
        for rep in range(args.repeats):
            eps = {}
            for name in (["planned", "former"] if rep % 2 == 0 else ["former", "planned"]):
                eng = engines[name]
                before = eng.prefill_slots
                t0 = time.perf_counter()
                eps[name], _ = agent.rollout(agent.tasks, eng, sandbox, 8, seed=7 + rep)
                seconds[name].append(time.perf_counter() - t0)
                slots[name].append(eng.prefill_slots - before)
            same.append(all(x.ids == y.ids and x.reward == y.reward for x, y in zip(eps["planned"], eps["former"])))
            print(f"rollout {rep}: former {seconds['former'][-1]:.2f} s ({slots['former'][-1]} slots), planned "
                  f"{seconds['planned'][-1]:.2f} s ({slots['planned'][-1]} slots), same episodes {same[-1]}", flush=True)
    ratios = [f / p for f, p in zip(seconds["former"], seconds["planned"])]
    result = {"fit": fit, "rollout_seconds": seconds, "prefill_slots": slots, "rollout_speedup": ratios,
              "rollout_speedup_median": float(np.median(ratios)), "same_episodes": same,
              "setup": {"policy": args.policy, "engine_rows": b, "cache": sampling.cache_size,
                        "prefill_buckets": list(sampling.prefill_buckets),
                        "row_buckets": {k: list(e.row_buckets) for k, e in engines.items()}, "repeats": args.repeats},
              "machine": machine()}
    print(f"rollout speed-up (former / planned): {', '.join(f'{r:.2f}x' for r in ratios)}; same episodes {all(same)}")
    write_result(args.out, result)


if __name__ == "__main__":
    reexec_with_tcmalloc()  # XLA:CPU's per-call scratch: see jaxrl_agent/cli/malloc_env.py
    main()
