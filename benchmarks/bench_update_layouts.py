"""The multi-turn GRPO update on one rollout's episodes, the batch laid out three ways, side by
side in one run (DEVICE + HOST): whole rows (each episode padded to the batch's length bucket,
as TRL's update), a group's shared first prompt run once (`TrajectoryConfig.share_prefix_min`)
and the rows packed for the model (`TrajectoryConfig.pack_forward`).

    python benchmarks/bench_update_layouts.py [--repeats 5] [--buckets 1024]   -> benchmarks/results/update_layouts.json

The episodes are one rollout of the agent benchmark's workload (`bench_vs_trl_agent.py`: the
demo policy, `--tasks` x `--group` bug-fixing episodes up to 1024 tokens, the study's episode
loop settings); the update is that benchmark's (token-mean GRPO, clip 0.2, AdamW, no KL, one
update over the batch). Every layout is compiled first and its loss checked equal to the whole
rows' (the same update up to float summation order); then each repeat times one update of
each layout, the order rotating repeat by repeat. Reports seconds per update per layout, the
ratios to whole rows, and how many token slots each layout runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_vs_trl as single  # noqa: E402
import bench_vs_trl_agent as agent_bench  # noqa: E402

LAYOUTS = ("whole", "shared", "packed")


def layouts(mult: int, rows: int, tasks: int, buckets: tuple[int, ...]) -> dict:
    """TrajectoryConfig per layout, as the agent benchmark's `--rows` (the packed row count
    unbucketed here: exactly what first-fit needs, rounded to the row multiple)."""
    from jaxrl_agent.config import TrajectoryConfig

    base = TrajectoryConfig(buckets=buckets, batch_multiple=mult, row_buckets=(rows,), share_prefix_min=0)
    return {"whole": base,
            "shared": replace(base, share_prefix_min=32, prefix_buckets=(256,),
                              prefix_rows=(-(-(tasks + 1) // mult) * mult,)),
            "packed": replace(base, pack_forward=True)}


def slots(batch) -> int:
    """Token positions the model runs for this batch (rows, prefixes or packed rows)."""
    if batch.pack_tokens is not None:
        return int(batch.pack_tokens.size)
    return int(batch.tokens.size) + (0 if batch.prefix_tokens is None else int(batch.prefix_tokens.size))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default=single.POLICY)
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--buckets", default=",".join(map(str, range(128, agent_bench.MAX_TOTAL + 128, 128))),
                    help="length buckets (default: the agent benchmark's, every 128 tokens; 1024 alone shows the "
                         "RL loop's power-of-two case, where sharing keeps the rows at 1024)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "update_layouts.json"))
    args = ap.parse_args(argv)

    from jaxrl_agent.agent.policy import load_policy
    from jaxrl_agent.config import LossConfig, OptimConfig, RolloutConfig, TrainConfig
    from jaxrl_agent.env.sandbox import Sandbox
    from jaxrl_agent.env.sandbox_memo import MEMO_ENTRIES
    from jaxrl_agent.losses.registry import LOSSES
    from jaxrl_agent.sampling.engine import SamplingEngine
    from jaxrl_agent.sampling.engine_config import episode_engine
    from jaxrl_agent.train.step import make_optimizer, make_train_step
    from jaxrl_agent.train.weight_sync import policy_for_engine
    from jaxrl_agent.trajectory import collate

    model, tok = load_policy(args.policy)
    ts = make_train_step(LOSSES["grpo"], make_optimizer(OptimConfig(learning_rate=args.lr)),
                         TrainConfig(loss=LossConfig(agg="token-mean", kl_coef=0.0)), model)
    state = ts.init_state(model, seed=0)
    agent = agent_bench.Agent(args.policy, args.tasks, "study")
    engine = SamplingEngine(policy_for_engine(ts, state),
                            episode_engine(tok, RolloutConfig(max_total_tokens=agent_bench.MAX_TOTAL)))
    with Sandbox(num_workers=2, memo_entries=MEMO_ENTRIES) as sandbox:
        eps, _ = agent.rollout(agent.tasks, engine, sandbox, args.group, seed=0)
    mult = ts.mesh.devices.size
    rows = -(-len(eps) // mult) * mult
    batches = {name: collate(eps, replace(cfg, pad_id=tok.pad_id))[0]
               for name, cfg in layouts(mult, rows, args.tasks, tuple(int(b) for b in args.buckets.split(","))).items()}
    first = {}
    for name in LAYOUTS:  # compile each layout; its first update's loss is the same update's
        t0 = time.perf_counter()
        _, metrics = ts(jax.tree.map(jnp.copy, state), batches[name])  # the step donates its state
        first[name] = {"loss": float(metrics["loss"]), "compile_and_first_s": time.perf_counter() - t0}
    for name in LAYOUTS[1:]:
        if not np.isclose(first[name]["loss"], first["whole"]["loss"], rtol=1e-4, atol=1e-6):
            raise RuntimeError(f"{name} rows' loss {first[name]['loss']} differs from whole rows' "
                               f"{first['whole']['loss']}: the layouts do not run the same update")
    times = {name: [] for name in LAYOUTS}
    for r in range(args.repeats):
        order = LAYOUTS[r % 3:] + LAYOUTS[:r % 3]
        for name in order:
            t0 = time.perf_counter()
            state, metrics = ts(state, batches[name])
            float(metrics["loss"])
            times[name].append(time.perf_counter() - t0)
    med = {name: float(np.median(v)) for name, v in times.items()}
    res = {"config": vars(args), "cpus": os.cpu_count(), "jax": jax.__version__, "episodes": len(eps),
           "tokens": sum(len(e) for e in eps), "slots": {name: slots(b) for name, b in batches.items()},
           "packed_rows": int(batches["packed"].pack_tokens.shape[0]), "first": first, "seconds": times,
           "median_s": med, "speedup_vs_whole": {name: med["whole"] / med[name] for name in LAYOUTS},
           "range_vs_whole": {name: [min(times["whole"]) / max(times[name]), max(times["whole"]) / min(times[name])]
                              for name in LAYOUTS}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({k: res[k] for k in ("tokens", "slots", "packed_rows", "median_s", "speedup_vs_whole")},
                     indent=2))
    return res


if __name__ == "__main__":
    from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc

    reexec_with_tcmalloc()
    main()
