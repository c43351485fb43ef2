"""The study's SFT step with batches drawn plainly against batches grouped by length
(`offline.DataIterator(group_by_length=k)`), side by side in one run (DEVICE + HOST).

    PYTHONPATH=. python benchmarks/bench_sft_batching.py [--demos 256] [--steps 60] [--repeats 3] [--group 16]

The workload is the study's SFT stage (`experiments/binary_search_rl/stages._fit`): its
demonstrations (`stages.demonstrations` on `--demos` training tasks, the study's styles and
made-up file-name share), its model size, batch 8, its length buckets and learning rate. A
batch is padded to the smallest bucket that fits its longest episode (`trajectory.collate`),
so a plainly shuffled batch pays for its longest row; grouped, a batch is a slice of a
mega-batch of k batches sorted by length. The compute is masked NLL over every slot, pad
included, so seconds follow padded tokens.

One `TrainStep` serves both settings and every bucket is compiled before anything is timed.
Each repeat runs `--steps` steps of each setting from the same initial weights and data
seed, the order alternating repeat by repeat, so background load hits both alike. Reports
seconds per step, real / padded tokens (the share of the step's slots that hold data) and
the speed-up, per repeat and as the range; writes benchmarks/results/sft_batching.json.
What grouping does to the trained policy is a separate question, answered on validation
instances, never here.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from bench_results import machine, write_result
from experiments.binary_search_rl import stages
from experiments.binary_search_rl.config import StudyConfig
from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc
from jaxrl_agent.config import OptimConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.loops.offline import DataIterator, run_sft
from jaxrl_agent.losses.registry import LOSSES
from jaxrl_agent.model.decoder import CausalLM
from jaxrl_agent.tokenizer import load_tokenizer
from jaxrl_agent.train.step import make_optimizer, make_train_step
from jaxrl_agent.trajectory import bucket_length, collate

BUCKETS = stages._fit.__kwdefaults__["buckets"]  # the study's SFT buckets, one home


def padding(episodes, batch_size: int, steps: int, seed: int, group: int) -> dict:
    """Real and padded tokens of the `steps` batches `run_sft` draws with these settings."""
    lengths = [len(e) for e in episodes]
    it = DataIterator(episodes, batch_size, seed=seed, lengths=lengths, group_by_length=group)
    real = padded = 0
    for _ in range(steps):
        batch = it.next()
        real += sum(len(e) for e in batch)
        padded += batch_size * bucket_length(max(len(e) for e in batch), BUCKETS)
    return {"real_tokens": real, "padded_tokens": padded, "real_share": real / padded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demos", type=int, default=256, help="training tasks demonstrated (one episode each)")
    ap.add_argument("--steps", type=int, default=60, help="SFT steps per setting and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--group", type=int, default=16, help="batches per mega-batch of the grouped setting")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sft_batching.json"))
    args = ap.parse_args()
    cfg = StudyConfig()
    batch_size = cfg.sft.batch_size
    with tempfile.TemporaryDirectory(prefix="jxa-bench-sft-") as work:
        study = replace(cfg, demos=replace(cfg.demos, num_tasks=args.demos), work_dir=work)
        with Sandbox(num_workers=cfg.sandbox_workers) as sandbox:
            episodes, _ = stages.demonstrations(study, sandbox)
    tok = load_tokenizer()
    model = CausalLM(cfg.model.build(tok.vocab_size), rngs=nnx.Rngs(cfg.seed))
    optim = OptimConfig(learning_rate=cfg.sft.learning_rate, schedule="cosine", warmup_steps=max(1, args.steps // 25),
                        total_steps=args.steps, min_lr_ratio=0.1, weight_decay=0.0, max_grad_norm=1.0)
    traj = TrajectoryConfig(buckets=BUCKETS, overflow="truncate")
    step = make_train_step(LOSSES["sft"], make_optimizer(optim), TrainConfig(), model)
    state = step.init_state(model, seed=0)
    longest = bucket_length(max(len(e) for e in episodes), BUCKETS)
    for T in [b for b in BUCKETS if b <= longest]:  # compile every bucket a batch can need
        state, metrics = step(state, collate(episodes[:batch_size], replace(traj, buckets=(T,)))[0])  # state donated
        jax.block_until_ready(metrics)
    settings = {"plain": 0, f"grouped_{args.group}": args.group}
    seconds = {k: [] for k in settings}
    pads = {k: [] for k in settings}
    for rep in range(args.repeats):
        for name in (list(settings) if rep % 2 == 0 else list(settings)[::-1]):
            t0 = time.perf_counter()
            run_sft(model, episodes, train_cfg=TrainConfig(), optim_cfg=optim, traj_cfg=traj, num_steps=args.steps,
                    batch_size=batch_size, seed=rep, group_by_length=settings[name], train_step=step)
            seconds[name].append((time.perf_counter() - t0) / args.steps)
            pads[name].append(padding(episodes, batch_size, args.steps, rep, settings[name]))
    plain, grouped = settings
    ratios = [a / b for a, b in zip(seconds[plain], seconds[grouped])]
    result = {
        "seconds_per_step": seconds, "padding": pads, "speedup_grouped": ratios,
        "speedup_range": [min(ratios), max(ratios)],
        "setup": {"demos": len(episodes), "mean_tokens": float(np.mean([len(e) for e in episodes])),
                  "batch_size": batch_size, "buckets": BUCKETS, "steps": args.steps, "repeats": args.repeats,
                  "group": args.group, "model": asdict(cfg.model)},
        "machine": machine(),
    }
    print(f"study SFT step, {len(episodes)} demonstrations, batch {batch_size}, {args.steps} steps x {args.repeats}")
    print(f"{'setting':12s} {'s/step (median)':>16s} {'real/padded tokens':>19s}")
    for name in settings:
        share = np.mean([p["real_share"] for p in pads[name]])
        print(f"{name:12s} {np.median(seconds[name]):16.3f} {share:19.2f}")
    print(f"grouped / plain speed-up per repeat: {', '.join(f'{r:.2f}x' for r in ratios)}")
    write_result(args.out, result)


if __name__ == "__main__":
    reexec_with_tcmalloc()  # XLA:CPU's per-call scratch: see jaxrl_agent/cli/malloc_env.py
    main()
