"""How fast could a decode step be? The matmuls alone, against `generate`'s whole step.

    python benchmarks/decode_matmul_floor.py [--batch 16] [--steps 256] [--repeats 3]

Same tiny Qwen2 as bench_sampling.py (hidden 256, MLP 1024, 4 layers, 8 heads / 2 KV heads,
vocab 512), batch 16. One decode step multiplies the 16 current hidden rows by every weight
matrix: per layer q, k, v, o, gate, up and down, then the tied unembedding. This script times
just those matmuls (plus the residual adds that chain one step to the next), `--steps` steps in
a row:
- in JAX: one jitted `fori_loop`, so no per-step dispatch at all;
- in PyTorch: the same loop of `torch.matmul` calls at its faster thread count;
and, in the same process, `transformers` `generate` (sampling at temperature 1, 256 new tokens
after a 128-token prompt, as in bench_sampling.py) for its time per generated step.

`generate`'s step time divided by the faster matmul-only step is the most any sampler built on
these two libraries' f32 matmul kernels could reach on this machine: attention, sampling, cache
writes and loop control all come on top. Prints a table and writes
benchmarks/results/decode_matmul_floor.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bench_sampling import VOCAB, hf_generate, make_checkpoint

NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weight_mats(hf_model) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    """Per layer {name: [in, out] f32}, and the unembedding [D, V] (the model's own weights)."""
    layers = []
    for layer in hf_model.model.layers:
        mods = {**{n: getattr(layer.self_attn, n) for n in NAMES[:4]}, **{n: getattr(layer.mlp, n) for n in NAMES[4:]}}
        layers.append({n: m.weight.detach().numpy().T.copy() for n, m in mods.items()})
    return layers, hf_model.model.embed_tokens.weight.detach().numpy().T.copy()


def one_step(x, layers, unembed, mm):
    """The decode step's matmuls on x [B, D]; `mm` is the library's matmul. Returns (x', logits)."""
    for w in layers:
        q, k, v = mm(x, w["q_proj"]), mm(x, w["k_proj"]), mm(x, w["v_proj"])
        o = mm(q, w["o_proj"])  # q stands in for attention's output (same shape)
        # k and v go to the cache in a real step; here they feed the residual so none is dead code
        h = x + 1e-3 * (o + k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True))
        d = mm(mm(h, w["gate_proj"]) * mm(h, w["up_proj"]), w["down_proj"])
        x = h + 1e-3 * d
    return x, mm(x, unembed)


def jax_seconds_per_step(x0: np.ndarray, layers, unembed, steps: int, repeats: int) -> float:
    layers_j = jax.tree.map(jnp.asarray, layers)

    @jax.jit
    def run(x, layers, unembed):
        def body(_, carry):
            x, acc = carry
            x, logits = one_step(x, layers, unembed, jnp.matmul)
            return x, acc + logits[:, 0]
        return jax.lax.fori_loop(0, steps, body, (x, jnp.zeros(x.shape[0], x.dtype)))

    args = (jnp.asarray(x0), layers_j, jnp.asarray(unembed))
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / steps


def torch_seconds_per_step(x0: np.ndarray, layers, unembed, steps: int, repeats: int, threads: int) -> float:
    torch.set_num_threads(threads)
    layers_t = [{n: torch.from_numpy(w) for n, w in layer.items()} for layer in layers]
    unembed_t, x_t = torch.from_numpy(unembed), torch.from_numpy(x0)
    times = []
    with torch.inference_mode():
        for r in range(repeats + 1):  # the first pass warms up
            x, t0 = x_t, time.perf_counter()
            for _ in range(steps):
                x, logits = one_step(x, layers_t, unembed_t, torch.matmul)
            if r:
                times.append(time.perf_counter() - t0)
    return float(np.median(times)) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_matmul_floor.json"))
    args = ap.parse_args()
    hf_model = make_checkpoint(tempfile.mkdtemp())
    layers, unembed = weight_mats(hf_model)
    x0 = np.random.default_rng(0).normal(0, 1, (args.batch, unembed.shape[0])).astype(np.float32)

    default_threads = torch.get_num_threads()
    thread_counts = sorted({default_threads, 1})
    prompts = torch.from_numpy(np.random.default_rng(0).integers(0, VOCAB, (args.batch, args.prompt)))
    hf_generate(hf_model, prompts, 8)  # warm-up
    gen = {}
    for n in thread_counts:
        torch.set_num_threads(n)
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            hf_generate(hf_model, prompts, args.steps)
            ts.append(time.perf_counter() - t0)
        gen[n] = float(np.median(ts)) / args.steps
    floor = {"jax": jax_seconds_per_step(x0, layers, unembed, args.steps, args.repeats)}
    for n in thread_counts:
        floor[f"torch_threads_{n}"] = torch_seconds_per_step(x0, layers, unembed, args.steps, args.repeats, n)
    torch.set_num_threads(default_threads)
    hf_step = min(gen.values())
    best = min(floor, key=floor.get)
    result = {
        "generate_ms_per_step": {str(n): 1e3 * s for n, s in gen.items()},
        "matmul_only_ms_per_step": {k: 1e3 * v for k, v in floor.items()},
        "fastest_matmul_only": best,
        "max_speedup_vs_hf_generate": hf_step / floor[best],
        "step_budget_ms_for_5x": 1e3 * hf_step / 5,
        "setup": {"batch": args.batch, "prompt": args.prompt, "steps": args.steps, "repeats": args.repeats,
                  "layers": len(layers), "hidden": int(unembed.shape[0]), "vocab": int(unembed.shape[1])},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                    "torch": torch.__version__},
    }
    print(f"generate, best thread count: {1e3 * hf_step:.3f} ms per step; a 5x sampler needs "
          f"{result['step_budget_ms_for_5x']:.3f} ms per step")
    for k, v in floor.items():
        print(f"matmuls only, {k:<16} {1e3 * v:.3f} ms per step")
    print(f"max_speedup_vs_hf_generate (matmuls only, {best}): {result['max_speedup_vs_hf_generate']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
