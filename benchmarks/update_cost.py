"""What the multi-turn agent benchmark's update costs and how close it runs to this machine's
matmul rate (DEVICE). Not a comparison: the figures the README's agent row reasons with.

    python benchmarks/update_cost.py [--rows 44] [--calls 5] [--pause 0] [--remat]

The update of `bench_vs_trl_agent.py` (the shipped demo policy, GRPO token-mean, AdamW; 48
episodes packed for the model into --rows rows of 1024), in this fresh process: XLA's cost
analysis (FLOPs) and memory analysis (scratch bytes) of the compiled step; the first call
(which faults the scratch in from the OS: minor faults and system CPU seconds from
`getrusage`) and --calls more, each with its faults; the FLOP rate of the fastest later call;
and one lone jitted f32 GEMM at the update's MLP shapes and at 2048^3, for the rate a matmul
alone reaches.
Writes benchmarks/results/update_cost.json.

`--remat` compiles the step with the model's `remat` on (each layer recomputed in the
backward pass): the memory it saves and the time it costs, against a run without.

A later call back to back (`--pause 0`) sometimes faults the whole scratch in again, at several
times the first call's system time per fault; with `--pause 1` none does (compare the runs'
`later_calls`). That fits the step's outputs being ready before XLA:CPU has freed the call's
scratch, so that the next call gets a fresh block from tcmalloc while the old one is held.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from bench_results import machine, write_result  # noqa: E402


def timed_call(fn) -> dict:
    r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), os.times(), time.perf_counter()
    fn()
    t1, c1, r1 = time.perf_counter(), os.times(), resource.getrusage(resource.RUSAGE_SELF)
    return {"s": t1 - t0, "minor_faults": r1.ru_minflt - r0.ru_minflt, "sys_s": c1.system - c0.system}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=44, help="packed rows of 1024 (the agent update's usual count)")
    ap.add_argument("--calls", type=int, default=5, help="calls after the first")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds to wait before each call (0: back to back, as a loop of steps runs)")
    ap.add_argument("--remat", action="store_true", help="the model's remat on (ModelConfig.remat)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/update_cost[_remat].json")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import bench_vs_trl_agent as agent_bench
    from jaxrl_agent.agent.policy import load_policy
    from jaxrl_agent.config import LossConfig, OptimConfig, TrainConfig, TrajectoryConfig
    from jaxrl_agent.losses.registry import LOSSES
    from jaxrl_agent.train.step import make_optimizer, make_train_step
    from jaxrl_agent.trajectory import collate, shape_episodes

    model, tok = load_policy(agent_bench.single.POLICY)
    if args.remat:
        model.config = dataclasses.replace(model.config, remat=True)
    ts = make_train_step(LOSSES["grpo"], make_optimizer(OptimConfig(learning_rate=1e-6)),
                         TrainConfig(loss=LossConfig(agg="token-mean", kl_coef=0.0)), model)
    state = {"s": ts.init_state(model, seed=0)}
    traj = TrajectoryConfig(buckets=(agent_bench.MAX_TOTAL,), share_prefix_min=0, pack_forward=True,
                            pack_rows=(args.rows,), row_buckets=(48,), pad_id=tok.pad_id)
    batch = collate(shape_episodes(traj), traj)[0]
    compiled = ts.precompile([batch])[0].result()
    cost = compiled.cost_analysis()
    flops = float((cost[0] if isinstance(cost, list) else cost)["flops"])
    temp = int(compiled.memory_analysis().temp_size_in_bytes)

    def step():
        state["s"], metrics = ts(state["s"], batch)
        float(metrics["loss"])

    calls = []
    for _ in range(args.calls + 1):
        time.sleep(args.pause)
        calls.append(timed_call(step))
    steady = min(c["s"] for c in calls[1:])  # a call that faulted nothing in
    gemm = {}
    for m, k, n in [(args.rows * agent_bench.MAX_TOTAL, 128, 384), (args.rows * agent_bench.MAX_TOTAL, 384, 128),
                    (2048, 2048, 2048)]:
        a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        f = jax.jit(lambda a, b: a @ b)
        f(a, b).block_until_ready()
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            times.append(time.perf_counter() - t0)
        gemm[f"{m}x{k}x{n}"] = 2 * m * k * n / float(np.median(times)) / 1e9
    # Under remat the layers run in a scan, whose body XLA's cost analysis counts once: no
    # FLOP count or rate for it (the recompute adds about one forward pass of FLOPs).
    flops = None if args.remat else flops
    rate = None if flops is None else flops / steady / 1e9
    result = {"rows": args.rows, "pause_s": args.pause, "remat": args.remat, "step_flops": flops,
              "scratch_gib": temp / 2**30, "first_call": calls[0], "later_calls": calls[1:], "fastest_later_s": steady,
              "gflops_per_s": rate, "lone_gemm_gflops_per_s": gemm,
              "machine": machine(malloc=os.environ.get("LD_PRELOAD", "default"))}
    print(f"update ({args.rows} packed rows x {agent_bench.MAX_TOTAL}{', remat' if args.remat else ''}): "
          + (f"{flops / 1e12:.3f} TFLOP, " if flops else "") + f"scratch {temp / 2**30:.2f} GiB; first call "
          f"{calls[0]['s']:.2f} s ({calls[0]['minor_faults']} minor faults, {calls[0]['sys_s']:.1f} s system); later calls "
          + ", ".join(f"{c['s']:.2f} s ({c['minor_faults']} faults)" for c in calls[1:])
          + (f"; the fastest {rate:.0f} GFLOP/s" if rate else "") + "; lone GEMMs "
          + ", ".join(f"{k} {v:.0f}" for k, v in gemm.items()) + " GFLOP/s")
    write_result(args.out or str(HERE / "results" / f"update_cost{'_remat' if args.remat else ''}.json"), result)


if __name__ == "__main__":
    from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc

    reexec_with_tcmalloc()  # as the CLI runs (jaxrl_agent/cli/malloc_env.py)
    main()
