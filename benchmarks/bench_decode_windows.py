"""The decode loop skipping the windows no live row fits in, against copying every window in
and out (the former loop), side by side (DEVICE + HOST).

    PYTHONPATH=. python benchmarks/bench_decode_windows.py [--reps 20] [--repeats 3]

`sampling.generate` runs one `while_loop` per attention window (W, 2W, ... below S, then S),
each on a copy of its window's slots. Late in an episode every live row is past the first
windows: their loops run no step, but the former loop still copied their slots in and out.
Now a `lax.cond` skips such a window. Two parts, alternating the two loops call by call:
- one decode call (16 steps, 16 rows, the shipped SFT policy, S = 1024, W = 256) with every
  row at 100, 400, 700 and 950 tokens: median ms per call, and whether both give the same
  tokens;
- one study RL iteration's rollout (6 tasks of its pool x 8, its tools and memoised sandbox,
  the memo emptied before each rollout): seconds per rollout and whether both give the same
  episodes.
Writes benchmarks/results/decode_windows.json.
"""
from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench_results import machine, write_result
from experiments.binary_search_rl.config import StudyConfig
from experiments.binary_search_rl.silent_bugs import rl_pool
from experiments.binary_search_rl.stages import ENGINE_ROWS, rollout_config, tools_config
from jaxrl_agent.agent.policy import load_policy
from jaxrl_agent.agent.rollout import collect_episodes
from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.sandbox_memo import MEMO_ENTRIES, CallMemo
from jaxrl_agent.sampling.decode import generate
from jaxrl_agent.sampling.engine import SamplingEngine
from jaxrl_agent.sampling.engine_config import episode_engine
from jaxrl_agent.tokenizer import ChatFormat

SFT = "experiments/binary_search_rl/results/policies/sft"


def former_generate_fn(model, config):
    """`make_sampler_fns`'s generate_fn with every window copied in and out."""
    graphdef, _ = nnx.split(model)

    @partial(jax.jit, donate_argnums=(1, 2))
    def fn(state, cache, logits, rows, base_seed, episode_seeds, active, max_new, stop_ids):
        del rows  # the engine below decodes every call on all B rows (decode_row_buckets=(B,))
        return generate(nnx.merge(graphdef, state), cache, logits, base_seed, episode_seeds, active, max_new, stop_ids,
                        config=config, skip_empty_windows=False)
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default=SFT)
    ap.add_argument("--reps", type=int, default=20, help="decode calls per loop and length")
    ap.add_argument("--repeats", type=int, default=3, help="rollouts per loop")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_windows.json"))
    args = ap.parse_args()
    cfg = StudyConfig()
    model, tok = load_policy(args.policy)
    rollout = rollout_config(cfg, group_size=8)
    # every decode call on all rows, as the former loop does: this compares the windows alone
    sampling = episode_engine(tok, rollout, batch_size=ENGINE_ROWS, decode_row_buckets=(ENGINE_ROWS,))
    engine = SamplingEngine(model, sampling)
    loops = {"skip": engine._generate_fn, "former": former_generate_fn(model, sampling)}
    b = sampling.batch_size
    seeds, active, all_rows = np.arange(b, dtype=np.int32), np.ones(b, bool), np.arange(b, dtype=np.int32)
    budget, stop = np.full(b, 16, np.int32), np.full((b, sampling.max_stop_tokens), -1, np.int32)

    def call(name, length):
        engine.cache = engine.cache.replace(lengths=jnp.full((b,), length, jnp.int32))
        t0 = time.perf_counter()
        out, engine.cache, engine.logits = loops[name](engine.state, engine.cache, engine.logits, all_rows,
                                                       engine._base_seed, seeds, active, budget, stop)
        out = jax.device_get(out)
        return time.perf_counter() - t0, np.asarray(out.tokens)

    decode = {}
    for length in (100, 400, 700, 950):
        ms, same = {"skip": [], "former": []}, True
        for name in loops:  # compile, and start both from the same logits
            call(name, length)
        for rep in range(args.reps):
            toks = {}
            for name in (["skip", "former"] if rep % 2 == 0 else ["former", "skip"]):
                engine.logits = jnp.zeros_like(engine.logits)  # same input to both
                s, toks[name] = call(name, length)
                ms[name].append(1000 * s)
            same &= bool((toks["skip"] == toks["former"]).all())
        decode[length] = {"median_ms": {k: float(np.median(v)) for k, v in ms.items()},
                          "speedup": float(np.median(ms["former"]) / np.median(ms["skip"])), "same_tokens": same}
        print(f"decode call at {length:4d} tokens: former {decode[length]['median_ms']['former']:6.1f} ms, "
              f"skip {decode[length]['median_ms']['skip']:6.1f} ms, {decode[length]['speedup']:.2f}x, same tokens {same}")

    tasks = rl_pool(cfg.rl.num_train_tasks, 0, cfg.rl.silent_bug_share, cfg.rl.canonical_like_share)[:6]
    chat, tools = ChatFormat(tok, tool_style=cfg.tool_style), tools_config(cfg)
    seconds, same_eps = {"skip": [], "former": []}, []
    with Sandbox(num_workers=cfg.sandbox_workers, memo_entries=MEMO_ENTRIES) as sandbox:
        engine.warmup()
        for name in loops:  # warm both loops and the sandbox
            engine._generate_fn = loops[name]
            collect_episodes(tasks[:1], engine, chat, sandbox, rollout_config(cfg, group_size=2), tools, seed=1)
        for rep in range(args.repeats):
            eps = {}
            for name in (["skip", "former"] if rep % 2 == 0 else ["former", "skip"]):
                engine._generate_fn = loops[name]
                sandbox.memo = CallMemo()  # empty for each rollout: neither answers the other's calls
                t0 = time.perf_counter()
                eps[name], _ = collect_episodes(tasks, engine, chat, sandbox, rollout, tools, seed=7 + rep)
                seconds[name].append(time.perf_counter() - t0)
            same_eps.append(all(x.ids == y.ids and x.reward == y.reward for x, y in zip(eps["skip"], eps["former"])))
    engine._generate_fn = loops["skip"]
    ratios = [f / s for f, s in zip(seconds["former"], seconds["skip"])]
    result = {"decode_call": decode, "rollout_seconds": seconds, "rollout_speedup": ratios,
              "rollout_speedup_median": float(np.median(ratios)), "same_episodes": same_eps,
              "setup": {"policy": args.policy, "engine_rows": b, "cache": sampling.cache_size,
                        "decode_window": sampling.decode_window, "reps": args.reps, "repeats": args.repeats},
              "machine": machine()}
    print(f"rollout (6 pool tasks x 8): former {', '.join(f'{x:.1f}' for x in seconds['former'])} s, "
          f"skip {', '.join(f'{x:.1f}' for x in seconds['skip'])} s; speed-up {', '.join(f'{r:.2f}x' for r in ratios)}; "
          f"same episodes {all(same_eps)}")
    write_result(args.out, result)


if __name__ == "__main__":
    reexec_with_tcmalloc()  # XLA:CPU's per-call scratch: see jaxrl_agent/cli/malloc_env.py
    main()
