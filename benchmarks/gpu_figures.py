"""Accelerator figures for the README: the train step's MFU on a Qwen2.5-0.5B-shaped model and
the sampling engine's tokens/s at 64 rows, one short run (well under 10 minutes on one GPU).

    python benchmarks/gpu_figures.py [--readme README.md]    -> benchmarks/results/gpu.json
    python benchmarks/gpu_figures.py --tiny                   (the same code at toy sizes: CPU test)

Model: Qwen2.5-0.5B's shape (vocab 151936, hidden 896, 24 layers, 14 query / 2 KV heads, SwiGLU
4864, tied embeddings, q/k/v biases), random weights, bf16 parameters.

1. Train step: one GRPO update (token-mean, clip 0.2, AdamW) on `--rows` x `--length` random
   tokens, half of each row policy tokens, the sharded jitted step of `train/step.py` on every
   local device (dp). Seconds per step are the median of `--steps` after the compile.
   FLOPs per step follow PaLM's MFU convention: 6 N T for the matmul parameters N (every
   non-embedding matrix plus the unembedding, which the tied table serves) and 12 L H Dh S T
   for attention over S positions, T tokens in all; MFU = FLOPs / seconds / peak, with the
   peak dense bf16 rate of the device (`--peak_tflops`, or the table `PEAK_TFLOPS` by device
   kind; none on CPU, where only the achieved TFLOP/s is reported).
2. Sampler: 64 rows of a `--prompt`-token random prompt, one turn of exactly `--new` tokens at
   temperature 1 (no stop token), on `SamplingEngine` after `warmup`; tokens/s = rows x new /
   median seconds (the prompt's prefill is inside the time).

`--readme PATH` rewrites the block between `<!-- gpu-figures:start -->` and
`<!-- gpu-figures:end -->` of PATH with the measured table.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agent.config import LossConfig, OptimConfig, SamplingConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.losses.registry import LOSSES
from jaxrl_agent.model.decoder import CausalLM, ModelConfig
from jaxrl_agent.sampling.engine import SamplingEngine
from jaxrl_agent.train.step import make_optimizer, make_train_step
from jaxrl_agent.trajectory import Episode, collate

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN25_05B = ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                         num_kv_heads=2, head_dim=64, rope_theta=1e6, tie_word_embeddings=True, qkv_bias=True,
                         architecture="Qwen2ForCausalLM")
TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, tie_word_embeddings=True, qkv_bias=True, architecture="Qwen2ForCausalLM")
# Dense bf16 peak, TFLOP/s, by a substring of `device_kind` (vendor datasheets, without sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "TPU v6": 918.0, "TPU v5p": 459.0,
               "TPU v5": 197.0, "TPU v4": 275.0}
START, END = "<!-- gpu-figures:start -->", "<!-- gpu-figures:end -->"


def peak_tflops(kind: str, given: float | None) -> float | None:
    if given:
        return given
    return next((v for k, v in PEAK_TFLOPS.items() if k.lower() in kind.lower()), None)


def random_model(cfg: ModelConfig, dtype) -> CausalLM:
    return CausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype)


def matmul_params(cfg: ModelConfig) -> int:
    """N of 6 N T: every matrix a token goes through (attention, MLP, unembedding)."""
    d, f, h, k, dh = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = d * h * dh + 2 * d * k * dh + h * dh * d + 3 * d * f
    return cfg.num_layers * per_layer + cfg.vocab_size * d


def train_step_figures(cfg: ModelConfig, dtype, rows: int, length: int, steps: int) -> dict:
    model = random_model(cfg, dtype)
    ts = make_train_step(LOSSES["grpo"], make_optimizer(OptimConfig(learning_rate=1e-6)),
                         TrainConfig(loss=LossConfig()), model)
    rng = np.random.default_rng(0)
    half = length // 2
    episodes = [Episode(rng.integers(0, cfg.vocab_size, length).tolist(), [0] * half + [1] * (length - half),
                        (-rng.random(length)).tolist(), [0] * length, reward=float(i % 2), group_id=i // 4)
                for i in range(rows)]
    batch = collate(episodes, TrajectoryConfig(buckets=(length,), batch_multiple=len(jax.devices())))[0]
    state = ts.init_state(model)
    del model
    t0 = time.perf_counter()
    state, metrics = ts(state, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = ts(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    sec = float(np.median(times))
    tokens = rows * length
    flops = 6 * matmul_params(cfg) * tokens + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length * tokens
    return {"rows": rows, "length": length, "s_per_step": sec, "first_step_s": compile_s,
            "tokens_per_s": tokens / sec, "tflops_per_s": flops / sec / 1e12, "flops_per_step": flops,
            "loss_finite": bool(np.isfinite(float(metrics["loss"])))}


def sampler_figures(cfg: ModelConfig, dtype, rows: int, prompt: int, new: int, repeats: int) -> dict:
    model = random_model(cfg, dtype)
    eng = SamplingEngine(model, SamplingConfig(temperature=1.0, max_new_tokens=new, batch_size=rows,
                                               cache_size=prompt + new, prefill_buckets=(prompt,), decode_window=0))
    del model
    t0 = time.perf_counter()
    eng.warmup()
    warmup_s = time.perf_counter() - t0
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (rows, prompt))
    times = []
    for rep in range(repeats + 1):  # the first also runs what warmup did not touch
        t0 = time.perf_counter()
        for b in range(rows):
            eng.start_episode(b, prompts[b], seed=rep * rows + b)
        n = int(eng.sample_turn().num_new.sum())
        if rep:
            times.append(time.perf_counter() - t0)
        assert n == rows * new, n
        for b in range(rows):
            eng.end_episode(b)
    sec = float(np.median(times))
    return {"rows": rows, "prompt": prompt, "new": new, "s_per_turn": sec, "tokens_per_s": rows * new / sec,
            "warmup_s": warmup_s}


def readme_block(res: dict) -> str:
    t, s = res["train_step"], res["sampler"]
    mfu = f"{100 * res['mfu']:.1f}%" if res["mfu"] is not None else "n/a (no peak for this device)"
    return (f"{START}\nMeasured by `python benchmarks/gpu_figures.py` on {res['devices']} x {res['device_kind']} "
            f"(jax {res['jax']}), {res['model']}, bf16 parameters, random weights:\n\n"
            "| figure | value |\n|---|---|\n"
            f"| train step, one GRPO update on {t['rows']} x {t['length']} tokens | {t['s_per_step']:.3f} s, "
            f"{t['tokens_per_s']:,.0f} tokens/s, {t['tflops_per_s']:.1f} TFLOP/s, MFU {mfu} |\n"
            f"| sampler, {s['rows']} rows, {s['prompt']}-token prompt + {s['new']} new tokens | "
            f"{s['tokens_per_s']:,.0f} tokens/s ({s['s_per_turn']:.2f} s per turn) |\n{END}")


def write_readme(path: str, block: str) -> None:
    text = open(path).read()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{path} has no {START} ... {END} block to fill: add the two markers where the GPU "
                         "figures belong")
    with open(path, "w") as f:
        f.write(pattern.sub(lambda _: block, text))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy sizes (the CPU test of this script)")
    ap.add_argument("--rows", type=int, default=None, help="train-step rows (default 16; tiny 8)")
    ap.add_argument("--length", type=int, default=None, help="train-step tokens per row (default 1024; tiny 32)")
    ap.add_argument("--steps", type=int, default=None, help="timed train steps (default 5; tiny 1)")
    ap.add_argument("--sampler_rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=None, help="sampler prompt tokens (default 128; tiny 8)")
    ap.add_argument("--new", type=int, default=None, help="sampler new tokens (default 256; tiny 8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak_tflops", type=float, default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu.json"))
    ap.add_argument("--readme", default=None)
    args = ap.parse_args(argv)
    pick = lambda value, full, tiny: value if value is not None else (tiny if args.tiny else full)  # noqa: E731
    cfg = TINY if args.tiny else QWEN25_05B
    dev = jax.devices()[0]
    res = {"device_kind": dev.device_kind, "platform": dev.platform, "devices": jax.device_count(),
           "jax": jax.__version__, "model": "toy Qwen2 shape" if args.tiny else "Qwen2.5-0.5B shape",
           "matmul_params": matmul_params(cfg)}
    res["train_step"] = train_step_figures(cfg, jnp.bfloat16, pick(args.rows, 16, 8), pick(args.length, 1024, 32),
                                           pick(args.steps, 5, 1))
    print("train step:", json.dumps(res["train_step"]), flush=True)
    res["sampler"] = sampler_figures(cfg, jnp.bfloat16, args.sampler_rows, pick(args.prompt, 128, 8),
                                     pick(args.new, 256, 8), args.repeats)
    print("sampler:", json.dumps(res["sampler"]), flush=True)
    peak = peak_tflops(dev.device_kind, args.peak_tflops) if dev.platform != "cpu" or args.peak_tflops else None
    res["peak_tflops_per_device"] = peak
    res["mfu"] = res["train_step"]["tflops_per_s"] / (peak * jax.device_count()) if peak else None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    if args.readme:
        write_readme(args.readme, readme_block(res))
    print(readme_block(res))
    return res


if __name__ == "__main__":
    main()
