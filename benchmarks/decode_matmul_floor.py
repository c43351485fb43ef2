"""How fast could a decode step be? The matmuls alone, against `generate`'s whole step.

    python benchmarks/decode_matmul_floor.py [--batch 16] [--steps 256] [--repeats 3] [--slots N]

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
writes and loop control all come on top. A second floor adds the one piece of that no sampler
can skip: each layer's attention of the 16 queries over a cache of the benchmark's mean length
(prompt + half the new tokens), written as two einsums and a softmax in each library. One more
pass of each JAX loop (matmuls only, matmuls with attention) is traced, for the time of one
weight-matmul kernel run there, the figure profile_decode.py gives inside the sampler's decode
loop: the attention loop's also reads every layer's cache, as the sampler does. Prints a table and writes
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


def one_step(x, layers, unembed, mm, attend=None):
    """The decode step's matmuls on x [B, D]; `mm` is the library's matmul. Returns (x', logits).

    `attend(q, layer)` -> [B, D], when given, is attention of the step's queries over that
    layer's cache; without it q stands in for attention's output (same shape)."""
    for i, w in enumerate(layers):
        q, k, v = mm(x, w["q_proj"]), mm(x, w["k_proj"]), mm(x, w["v_proj"])
        o = mm(q if attend is None else attend(q, i), w["o_proj"])
        # k and v go to the cache in a real step; here they feed the residual so none is dead code
        h = x + 1e-3 * (o + k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True))
        d = mm(mm(h, w["gate_proj"]) * mm(h, w["up_proj"]), w["down_proj"])
        x = h + 1e-3 * d
    return x, mm(x, unembed)


def attention_fns(caches, heads: int, lib):
    """`attend(q, layer)` for `one_step`: softmax attention of q [B, H * Dh] over the layer's
    cached keys and values [B, K, S, Dh] (grouped queries, as in the model), in `lib`. JAX
    multiplies keys stored as [B, K, Dh, S], the layout of our sampler's cache (its fastest)."""
    kc, vc = caches
    b, kv, _, dh = vc[0].shape
    g, scale = heads // kv, 1.0 / dh ** 0.5

    def attend_jax(q, i):
        # the sampler's subscripts, so profile_decode.library_kernel_role names these kernels alike
        s = jnp.einsum("bkqd,bkds->bkqs", q.reshape(b, kv, g, dh) * scale, kc[i])
        return jnp.einsum("bkqs,bksd->bkqd", jax.nn.softmax(s, axis=-1), vc[i]).reshape(b, -1)

    def attend_torch(q, i):
        s = torch.matmul(q.reshape(b, kv, g, dh) * scale, kc[i].transpose(-1, -2))
        return torch.matmul(torch.softmax(s, dim=-1), vc[i]).reshape(b, -1)

    return attend_jax if lib == "jax" else attend_torch


def jax_seconds_per_step(x0: np.ndarray, layers, unembed, steps: int, repeats: int,
                         caches=None, heads: int = 0, trace: bool = False):
    """Median seconds per step of the jitted loop; with `trace`, also one traced pass's figures
    as profile_decode.py gives them for the sampler's decode loop (its tracer and kernel roles):
    mean microseconds of one run by role, the weight matmuls' overlap with other kernels, and
    the step's time with no, one, or several kernels running."""
    layers_j = jax.tree.map(jnp.asarray, layers)
    caches_j = None if caches is None else ([jnp.asarray(k.transpose(0, 1, 3, 2)) for k in caches[0]],
                                            [jnp.asarray(v) for v in caches[1]])

    @jax.jit
    def run(x, layers, unembed, caches):
        attend = None if caches is None else attention_fns(caches, heads, "jax")

        def body(_, carry):
            x, acc = carry
            x, logits = one_step(x, layers, unembed, jnp.matmul, attend)
            return x, acc + logits[:, 0]
        return jax.lax.fori_loop(0, steps, body, (x, jnp.zeros(x.shape[0], x.dtype)))

    args = (jnp.asarray(x0), layers_j, jnp.asarray(unembed), caches_j)
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - t0)
    seconds = float(np.median(times)) / steps
    if not trace:
        return seconds
    from profile_decode import kernel_runs, library_kernel_role, occupancy, op_names, overlap

    names, trace_dir = op_names(run.lower(*args).compile().as_text()), tempfile.mkdtemp()
    jax.profiler.start_trace(trace_dir)
    jax.block_until_ready(run(*args))
    jax.profiler.stop_trace()
    by_role: dict[str, list[float]] = {}
    for n, t in kernel_runs(trace_dir, full_names=True):
        if n.startswith("ynn_fusion"):
            by_role.setdefault(library_kernel_role(names.get(n, "")), []).append(t)
    return seconds, {"us_per_run": {role: float(np.mean(us)) for role, us in sorted(by_role.items())},
                     "weight_matmul_overlap": overlap(trace_dir, names),
                     "occupancy_us_per_step": {k: v / steps for k, v in occupancy(trace_dir).items()}}


def torch_seconds_per_step(x0: np.ndarray, layers, unembed, steps: int, repeats: int, threads: int,
                           caches=None, heads: int = 0) -> float:
    torch.set_num_threads(threads)
    layers_t = [{n: torch.from_numpy(w) for n, w in layer.items()} for layer in layers]
    unembed_t, x_t = torch.from_numpy(unembed), torch.from_numpy(x0)
    attend = None
    if caches is not None:
        attend = attention_fns(tuple([torch.from_numpy(c) for c in cs] for cs in caches), heads, "torch")
    times = []
    with torch.inference_mode():
        for r in range(repeats + 1):  # the first pass warms up
            x, t0 = x_t, time.perf_counter()
            for _ in range(steps):
                x, logits = one_step(x, layers_t, unembed_t, torch.matmul, attend)
            if r:
                times.append(time.perf_counter() - t0)
    return float(np.median(times)) / steps


def report_trace(label: str, traced: dict) -> None:
    """Print one traced loop's figures in profile_decode.py's words."""
    for role, us in traced["us_per_run"].items():
        print(f"  {label}, traced: {role:48s} {us:6.1f} us per run")
    ov, occ = traced["weight_matmul_overlap"], traced["occupancy_us_per_step"]
    print(f"  {label}, traced: weight matmuls {100 * ov['overlapped_share']:.0f}% of their time beside another "
          f"kernel; alone {ov['alone_mean_us']:.1f} us, beside another {ov['beside_another_mean_us']:.1f} us")
    print(f"  {label}, traced, per step: {occ['span_us']:.0f} us, no kernel running {occ['idle_us']:.0f}, "
          f"one {occ['one_kernel_us']:.0f}, two or more {occ['two_or_more_us']:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", type=int, default=None,
                    help="cache slots each layer's attention reads (default: the mean length, prompt + steps / 2; "
                         "the sampler reads its whole attention window, 256 or 512 slots at the defaults)")
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
    floor = {}
    floor["jax"], traced = jax_seconds_per_step(x0, layers, unembed, args.steps, args.repeats, trace=True)
    for n in thread_counts:
        floor[f"torch_threads_{n}"] = torch_seconds_per_step(x0, layers, unembed, args.steps, args.repeats, n)
    # With attention: every layer's queries over a cache of the benchmark's mean length (the
    # prompt plus half the new tokens), K and V random, grouped as in the model.
    cfg = hf_model.config
    kv, dh = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    slots = args.slots or args.prompt + args.steps // 2
    rng = np.random.default_rng(1)
    caches = tuple([rng.normal(0, 1, (args.batch, kv, slots, dh)).astype(np.float32) for _ in layers]
                   for _ in range(2))
    heads = cfg.num_attention_heads
    # Traced as well: do the weight matmuls themselves slow down once each step also reads the
    # caches (weights and caches together outgrow the shared L3 that holds the weights alone)?
    floor_attn = {}
    floor_attn["jax"], traced_attn = jax_seconds_per_step(x0, layers, unembed, args.steps, args.repeats,
                                                             caches, heads, trace=True)
    for n in thread_counts:
        floor_attn[f"torch_threads_{n}"] = torch_seconds_per_step(
            x0, layers, unembed, args.steps, args.repeats, n, caches, heads)
    torch.set_num_threads(default_threads)
    hf_step = min(gen.values())
    best = min(floor, key=floor.get)
    best_attn = min(floor_attn, key=floor_attn.get)
    result = {
        "generate_ms_per_step": {str(n): 1e3 * s for n, s in gen.items()},
        "matmul_only_ms_per_step": {k: 1e3 * v for k, v in floor.items()},
        "fastest_matmul_only": best,
        "matmul_only_jax_traced": traced,
        "max_speedup_vs_hf_generate": hf_step / floor[best],
        "step_budget_ms_for_5x": 1e3 * hf_step / 5,
        "matmul_attention_ms_per_step": {k: 1e3 * v for k, v in floor_attn.items()},
        "attention_slots": slots,
        "matmul_attention_jax_traced": traced_attn,
        "fastest_matmul_attention": best_attn,
        "max_speedup_vs_hf_generate_with_attention": hf_step / floor_attn[best_attn],
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
    report_trace("matmuls only", traced)
    for k, v in floor_attn.items():
        print(f"matmuls + attention over {slots} slots, {k:<16} {1e3 * v:.3f} ms per step")
    report_trace(f"matmuls + attention over {slots} slots", traced_attn)
    print(f"max_speedup_vs_hf_generate_with_attention ({best_attn}): "
          f"{result['max_speedup_vs_hf_generate_with_attention']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
