"""The causal attention's own backward pass (`layers._block_attention`: each query block's
softmax recomputed from its log-sum-exp) against autodiff of the plain softmax (the former
attention), side by side on the multi-turn agent benchmark's update (DEVICE).

    python benchmarks/bench_attention_backward.py [--repeats 2] [--calls 5] [--rows 44]

The update of `bench_vs_trl_agent.py` (the shipped demo policy, GRPO token-mean, AdamW; its
48 episodes packed for the model into --rows rows of 1024 tokens), each variant in a fresh
process, alternating which goes first, so each first call pays what a new run pays: XLA's
scratch for the step (`temp_bytes`, from the compiled step's memory analysis) is faulted in
from the OS 4 KiB at a time (minor faults and system CPU seconds reported), then --calls
more calls give the steady time. Both variants compute the same loss (reported).
Writes benchmarks/results/attention_backward.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from bench_results import machine, write_result  # noqa: E402


def run_variant(variant: str, rows: int, calls: int) -> dict:
    """In this process: build the agent benchmark's train step, precompile, time the calls."""
    import jax
    import numpy as np

    from jaxrl_agent.model import layers

    if variant == "autodiff":  # the former attention: autodiff of the block's softmax
        def plain(qi, k_n, v_n, mask, g):
            s = jax.numpy.where(mask[:, None, None], layers._block_scores(qi, k_n, g), layers.MASKED)
            p = jax.nn.softmax(s, axis=-1).astype(v_n.dtype).reshape(*qi.shape[:3], k_n.shape[2])
            return jax.numpy.einsum("bkqs,bksd->bkqd", p, v_n)
        layers._block_attention = plain
    from jaxrl_agent.agent.policy import load_policy
    from jaxrl_agent.config import LossConfig, OptimConfig, TrainConfig, TrajectoryConfig
    from jaxrl_agent.losses.registry import LOSSES
    from jaxrl_agent.train.step import make_optimizer, make_train_step
    from jaxrl_agent.trajectory import collate, shape_episodes

    import bench_vs_trl_agent as agent_bench

    model, tok = load_policy(agent_bench.single.POLICY)
    ts = make_train_step(LOSSES["grpo"], make_optimizer(OptimConfig(learning_rate=1e-6)),
                         TrainConfig(loss=LossConfig(agg="token-mean", kl_coef=0.0)), model)
    state = ts.init_state(model, seed=0)
    traj = TrajectoryConfig(buckets=(agent_bench.MAX_TOTAL,), share_prefix_min=0, pack_forward=True,
                            pack_rows=(rows,), row_buckets=(48,), pad_id=tok.pad_id)
    batch = collate(shape_episodes(traj), traj)[0]
    compiled = ts.precompile([batch])[0].result()
    temp = compiled.memory_analysis().temp_size_in_bytes
    out = []
    for _ in range(calls + 1):
        r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), os.times(), time.perf_counter()
        state, metrics = ts(state, batch)
        loss = float(metrics["loss"])
        t1, c1, r1 = time.perf_counter(), os.times(), resource.getrusage(resource.RUSAGE_SELF)
        out.append({"s": t1 - t0, "minor_faults": r1.ru_minflt - r0.ru_minflt, "sys_s": c1.system - c0.system,
                    "loss": loss})
    return {"variant": variant, "temp_bytes": int(temp), "first": out[0],
            "steady_s": float(np.median([c["s"] for c in out[1:]])), "calls": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes per variant")
    ap.add_argument("--calls", type=int, default=5, help="calls after the first, per process")
    ap.add_argument("--rows", type=int, default=44, help="packed rows of 1024 (the agent update's usual count)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant here
    ap.add_argument("--out", default=str(HERE / "results" / "attention_backward.json"))
    args = ap.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.variant, args.rows, args.calls)), flush=True)
        return
    runs = {"recompute": [], "autodiff": []}
    for rep in range(args.repeats):
        for variant in (["recompute", "autodiff"] if rep % 2 == 0 else ["autodiff", "recompute"]):
            cmd = [sys.executable, __file__, f"--variant={variant}", f"--rows={args.rows}", f"--calls={args.calls}"]
            text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            res = json.loads(next(line for line in text.splitlines() if line.startswith("RESULT "))[7:])
            runs[variant].append(res)
            print(f"{variant:9s} temp {res['temp_bytes'] / 2**30:.2f} GiB, first call {res['first']['s']:.2f} s "
                  f"({res['first']['minor_faults']} minor faults, {res['first']['sys_s']:.1f} s system), "
                  f"then {res['steady_s']:.2f} s", flush=True)
    summary = {v: {"temp_gib": r[0]["temp_bytes"] / 2**30, "first_s": [x["first"]["s"] for x in r],
                   "steady_s": [x["steady_s"] for x in r], "loss": r[0]["calls"][0]["loss"]} for v, r in runs.items()}
    summary["ratios"] = {"temp": runs["autodiff"][0]["temp_bytes"] / runs["recompute"][0]["temp_bytes"],
                         "first_call": [a["first"]["s"] / b["first"]["s"] for a, b in zip(runs["autodiff"], runs["recompute"])],
                         "steady": [a["steady_s"] / b["steady_s"] for a, b in zip(runs["autodiff"], runs["recompute"])]}
    print(json.dumps(summary["ratios"]))
    result = {"summary": summary, "runs": runs, "setup": {"rows": args.rows, "calls": args.calls, "repeats": args.repeats},
              "machine": machine(malloc=os.environ.get("LD_PRELOAD", "default"))}
    write_result(args.out, result)


if __name__ == "__main__":
    from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc

    reexec_with_tcmalloc()  # as the CLI runs (jaxrl_agent/cli/malloc_env.py); children inherit it
    main()
