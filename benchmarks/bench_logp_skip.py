"""The study's SFT step with logits only in the chunks that hold a loss position against
every chunk (`TrainConfig.logp_loss_chunks_only`), side by side in one run (DEVICE + HOST).

    PYTHONPATH=. python benchmarks/bench_logp_skip.py [--steps 20] [--repeats 3] [--data drills demos]

The workloads are the study's two long SFT fits (`experiments/binary_search_rl/stages._fit`):
the edit drills of the pretrain stage (`drills.make_drills`, its `extra_edits`, on
`--tasks` training instances) and the expert demonstrations of the SFT stage
(`stages.demonstrations`), at the study's model size, batch, buckets and learning rate. The
log-prob path cuts the sequence into `logp_chunk_size` chunks and computes each chunk's
`[B, chunk, V]` logits; an episode's prompt (system, tools, task) and the padding up to its
bucket carry no loss, so where no row of the batch has a loss position the chunk can be
skipped (`logprobs.token_logprobs_and_entropy(mask=)`).

Both settings run the same batches from the same weights; the first step's losses are
checked equal (the skip changes no read value). Each repeat runs `--steps` steps of each
setting, the order alternating repeat by repeat, after every bucket is compiled. Reports
seconds per step and the speed-up per repeat and as the range; writes
benchmarks/results/logp_skip.json.
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
from experiments.binary_search_rl.drills import make_drills, module_renamed_tasks
from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc
from jaxrl_agent.config import OptimConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.env.sandbox import Sandbox
from jaxrl_agent.env.tasks import generate_tasks
from jaxrl_agent.loops.offline import run_sft
from jaxrl_agent.losses.registry import LOSSES
from jaxrl_agent.model.decoder import CausalLM
from jaxrl_agent.tokenizer import load_tokenizer
from jaxrl_agent.train.step import make_optimizer, make_train_step
from jaxrl_agent.trajectory import bucket_length, collate

BUCKETS = stages._fit.__kwdefaults__["buckets"]  # the study's SFT buckets, one home


def workload(name: str, cfg: StudyConfig, tasks: int) -> list:
    """The episodes of one of the study's fits: "drills" (pretrain) or "demos" (SFT)."""
    if name == "drills":
        p = cfg.pretrain
        pool = module_renamed_tasks(generate_tasks("train", tasks, cfg.seed + 100), cfg.seed + 100, made_up=True,
                                    share=p.made_up_modules, words=p.word_modules)
        return make_drills(pool, stages.chat_format(cfg), seed=cfg.seed, extra_edits=p.extra_edits)
    with tempfile.TemporaryDirectory(prefix="jxa-bench-logp-") as work:
        study = replace(cfg, demos=replace(cfg.demos, num_tasks=tasks), work_dir=work)
        with Sandbox(num_workers=cfg.sandbox_workers) as sandbox:
            return stages.demonstrations(study, sandbox)[0]


def time_workload(episodes: list, cfg: StudyConfig, steps: int, repeats: int, lr: float) -> dict:
    tok = load_tokenizer()
    model = CausalLM(cfg.model.build(tok.vocab_size), rngs=nnx.Rngs(cfg.seed))
    batch_size = cfg.sft.batch_size
    optim = OptimConfig(learning_rate=lr, schedule="cosine", warmup_steps=1, total_steps=steps, min_lr_ratio=0.1,
                        weight_decay=0.0, max_grad_norm=1.0)
    traj = TrajectoryConfig(buckets=BUCKETS, overflow="truncate")
    settings = {"every_chunk": TrainConfig(logp_loss_chunks_only=False), "loss_chunks": TrainConfig()}
    longest = bucket_length(max(len(e) for e in episodes), BUCKETS)
    steps_by, first_loss = {}, {}
    for name, tcfg in settings.items():
        step = make_train_step(LOSSES["sft"], make_optimizer(optim), tcfg, model)
        for T in [b for b in BUCKETS if b <= longest]:  # compile every bucket a batch can need
            _, metrics = step(step.init_state(model, seed=0), collate(episodes[:batch_size], replace(traj, buckets=(T,)))[0])
            jax.block_until_ready(metrics)
            first_loss.setdefault(name, []).append(float(metrics["loss"]))
        steps_by[name] = step
    if first_loss["every_chunk"] != first_loss["loss_chunks"]:
        raise AssertionError(f"the skip changed a loss: {first_loss}")
    seconds = {k: [] for k in settings}
    for rep in range(repeats):
        for name in (list(settings) if rep % 2 == 0 else list(settings)[::-1]):
            t0 = time.perf_counter()
            run_sft(model, episodes, train_cfg=settings[name], optim_cfg=optim, traj_cfg=traj, num_steps=steps,
                    batch_size=batch_size, seed=rep, train_step=steps_by[name])
            seconds[name].append((time.perf_counter() - t0) / steps)
    ratios = [a / b for a, b in zip(seconds["every_chunk"], seconds["loss_chunks"])]
    lengths = [len(e) for e in episodes]
    loss_share = float(np.mean([sum(e.loss_mask) / len(e) for e in episodes]))
    return {"seconds_per_step": seconds, "speedup": ratios, "speedup_range": [min(ratios), max(ratios)],
            "episodes": len(episodes), "mean_tokens": float(np.mean(lengths)), "loss_token_share": loss_share,
            "first_step_losses": first_loss["loss_chunks"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="+", default=["drills", "demos"], choices=["drills", "demos"])
    ap.add_argument("--tasks", type=int, default=256, help="training instances drilled / demonstrated")
    ap.add_argument("--steps", type=int, default=20, help="steps per setting and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "logp_skip.json"))
    args = ap.parse_args()
    cfg = StudyConfig()
    lrs = {"drills": cfg.pretrain.learning_rate, "demos": cfg.sft.learning_rate}
    result = {"setup": {"steps": args.steps, "repeats": args.repeats, "batch_size": cfg.sft.batch_size,
                        "buckets": BUCKETS, "logp_chunk_size": TrainConfig().logp_chunk_size,
                        "model": asdict(cfg.model)},
              "machine": machine()}
    for name in args.data:
        r = result[name] = time_workload(workload(name, cfg, args.tasks), cfg, args.steps, args.repeats, lrs[name])
        print(f"{name}: {r['episodes']} episodes, {r['mean_tokens']:.0f} tokens, loss on {r['loss_token_share']:.2f}; "
              f"s/step every chunk {np.median(r['seconds_per_step']['every_chunk']):.3f}, loss chunks "
              f"{np.median(r['seconds_per_step']['loss_chunks']):.3f}; speed-up per repeat "
              + ", ".join(f"{x:.2f}x" for x in r["speedup"]), flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    reexec_with_tcmalloc()  # XLA:CPU's per-call scratch: see jaxrl_agent/cli/malloc_env.py
    main()
