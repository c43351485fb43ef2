"""GRPO train step side by side: our jitted, sharded step vs the same model and loss in PyTorch
(`transformers` Qwen2, identical weights, AdamW, grad clipping), CPU, one process.

    python benchmarks/bench_train_step.py [--batch 16] [--seq 256] [--repeats 10]

Two model sizes: "tiny" is the random Qwen2 of bench_sampling.py (~4M params: vocab 512,
hidden 256, 4 layers, 8 heads / 2 kv heads, tied embeddings), the headline
`speedup_vs_torch`; "test" is the size the unit tests train (vocab 256, hidden 64, 2 layers),
where per-op overhead rather than FLOPs dominates. A batch is B episodes of T tokens (prompt,
response, tool result, response; right-padded), groups of 4, the GRPO loss (group advantages,
PPO clip 0.2 with dual clip 3, seq-mean-token-mean aggregation), then clip-by-norm 1.0 and
AdamW. Both sides compute per-token log-probs and entropies (the entropy is a metric).

Correctness first: at identical weights both sides must give the same per-token log-probs and
the same loss before anything is timed. The contenders then alternate step by step, so
background load on the shared cores hits them alike; torch runs at its default thread count
and at one thread, and the faster is the reference. tokens/s is the number of real (non-pad)
tokens / median seconds per step. Prints a table and writes benchmarks/results/train_step.json.

Where the time goes (tiny size, measured separately): projections are 2-D GEMMs (a 3-D
einsum's gradient on XLA:CPU transposed the activations), layers run unrolled, and attention
works in a [B, K, G*T, Dh] layout with causal query blocks (model/decoder.py, model/layers.py); the policy
gradient went 2.75 s -> 1.13 s on a loaded machine. Most of what is left is GEMM time
(~60%), then the masked softmax and SwiGLU elementwise passes.

Allocator: XLA:CPU takes each step's scratch (782 MB at the tiny size, `xla_temp_bytes_per_step`)
from malloc and frees it after the call; glibc's malloc maps it afresh on every step and faults
it in 4 KiB at a time. By default the script re-executes itself with tcmalloc preloaded when
the machine has it, as the project's entry points do (jaxrl_agent/cli/malloc_env.py), so both
contenders run with it, and then reruns the tiny size in a child process with the default
malloc: the JSON holds both (`malloc`, `default_malloc`).

How close to the machine: each size also reports the step's matmul FLOPs per second (an
analytic count, `step_matmul_flops`) against the GFLOP/s of its largest GEMM run alone
(`gemm_ceiling`), for both libraries, and the share of that ceiling a step 1.5x faster than
torch would have to sustain.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import torch
import transformers

from jaxrl_agent.cli.malloc_env import reexec_with_tcmalloc, tcmalloc_active, without_tcmalloc
from jaxrl_agent.config import LossConfig, MeshConfig, OptimConfig, TrainConfig, TrajectoryConfig
from jaxrl_agent.hf import load_pretrained
from jaxrl_agent.losses.registry import LOSSES
from jaxrl_agent.train.sharding import make_mesh
from jaxrl_agent.train.step import make_optimizer, make_train_step
from jaxrl_agent.trajectory import Episode, collate

GROUP = 4
SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2),
    "test": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
LOSS = LossConfig(agg="seq-mean-token-mean", kl_coef=0.0, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
OPTIM = OptimConfig(learning_rate=1e-5, weight_decay=0.01, max_grad_norm=1.0)


# ---- shared weights and data ----
def make_checkpoint(path: str, size: str) -> transformers.Qwen2ForCausalLM:
    """A random Qwen2 of SIZES[size], saved to `path`."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        **SIZES[size], max_position_embeddings=2048,
        tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    cfg.initializer_range = 0.1
    model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return model


def make_batch(B: int, T: int, vocab: int, seed: int = 0):
    """B multi-turn episodes of 0.6 T .. T tokens, groups of GROUP with 0/1 rewards."""
    rng = np.random.default_rng(seed)
    eps = []
    for i in range(B):
        n = int(rng.integers(int(0.6 * T), T + 1))
        p, r1, o = n // 4, n // 4, n // 8
        mask = [0] * p + [1] * r1 + [0] * o + [1] * (n - p - r1 - o)
        eps.append(Episode(rng.integers(1, vocab, n).tolist(), mask, [0.0] * n, [0] * n, float(rng.integers(0, 2)),
                           i // GROUP))
    batch, _ = collate(eps, TrajectoryConfig(buckets=(T,)))
    return batch


# ---- the PyTorch side ----
def torch_outputs(model, tokens, attention_mask):
    """Per-token logp / entropy [B, T] aligned like ours (position t scores tokens[t]; t=0 -> 0)."""
    logits = model(input_ids=tokens, attention_mask=attention_mask).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    lp = logprobs.gather(-1, tokens[:, 1:, None])[..., 0]
    with torch.no_grad():  # a metric, as on our side (its gradient is unused there too)
        ent = -(logprobs.exp() * logprobs).sum(-1)
    zero = torch.zeros_like(lp[:, :1])
    return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1)


def torch_grpo_loss(logp, old_logp, mask, reward, group_id):
    """GRPO as in loss_registry.grpo_loss with LOSS: group advantages (unbiased std, eps 1e-6),
    clipped + dual-clipped surrogate, seq-mean-token-mean."""
    same = (group_id[:, None] == group_id[None, :]).float()  # [B, B]
    n = same.sum(1)
    mean = same @ reward / n
    var = (same * (reward[None, :] - mean[:, None]) ** 2).sum(1) / (n - 1).clamp(min=1)
    std = torch.where(n > 1, var.sqrt(), torch.ones_like(var))
    adv = torch.where(n > 1, (reward - mean) / (std + 1e-6), reward - mean)
    a = adv[:, None] * mask
    ratio = torch.exp(torch.clamp(logp - old_logp, -20, 20))
    l = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - LOSS.clip_low, 1 + LOSS.clip_high))
    l = torch.where(a < 0, torch.minimum(l, -a * LOSS.dual_clip), l)
    n_tok = mask.sum(1)
    per_seq = (l * mask).sum(1) / n_tok.clamp(min=1)
    return per_seq.sum() / (n_tok > 0).float().sum().clamp(min=1)


def make_torch_step(model, batch):
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.learning_rate, betas=(OPTIM.b1, OPTIM.b2), eps=OPTIM.eps,
                            weight_decay=OPTIM.weight_decay)
    t = {k: torch.from_numpy(np.asarray(getattr(batch, k))) for k in
         ("tokens", "attention_mask", "loss_mask", "old_logp", "reward", "group_id")}
    tokens, am = t["tokens"].long(), t["attention_mask"].long()
    mask = t["loss_mask"].float()

    def step():
        opt.zero_grad(set_to_none=True)
        logp, ent = torch_outputs(model, tokens, am)
        loss = torch_grpo_loss(logp, t["old_logp"], mask, t["reward"], t["group_id"])
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.max_grad_norm)
        opt.step()
        return loss.item(), gnorm.item()

    return step


# ---- how close to the machine's GEMM throughput ----
def step_matmul_flops(size: str, B: int, T: int) -> float:
    """FLOPs of one step's matmuls on the padded [B, T] batch: every projection and the tied
    unembedding (2 per multiply-add per token), causal attention scores and values (half of
    T x T), forward plus backward (twice the forward: input and weight gradients)."""
    c = SIZES[size]
    D, I, V, L, H = (c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"],
                     c["num_attention_heads"])
    dh = D // H
    kv = c["num_key_value_heads"] * dh
    per_token = L * (D * D + 2 * D * kv + D * D + 3 * D * I) + D * V
    forward = 2 * B * T * per_token + L * 2 * B * H * T * T * dh
    return 3.0 * forward


def gemm_ceiling(size: str, B: int, T: int, repeats: int = 20) -> dict:
    """GFLOP/s of the step's largest GEMM alone ([B*T, hidden] x [hidden, intermediate], f32),
    jitted JAX and torch at its faster thread count: what either library's matmul kernel
    reaches on this machine with no other work around it."""
    c = SIZES[size]
    rng = np.random.default_rng(0)
    a = rng.standard_normal((B * T, c["hidden_size"]), np.float32)
    w = rng.standard_normal((c["hidden_size"], c["intermediate_size"]), np.float32)
    flops = 2.0 * a.shape[0] * a.shape[1] * w.shape[1]
    mm = jax.jit(lambda x, y: x @ y)
    ja, jw = jax.device_put(a), jax.device_put(w)
    ta, tw = torch.from_numpy(a), torch.from_numpy(w)
    jax.block_until_ready(mm(ja, jw))
    default_threads = torch.get_num_threads()
    times = {"jax": [], **{f"torch_{n}": [] for n in sorted({default_threads, 1})}}
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(mm(ja, jw))
        times["jax"].append(time.perf_counter() - t0)
        for n in sorted({default_threads, 1}):
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            torch.matmul(ta, tw)
            times[f"torch_{n}"].append(time.perf_counter() - t0)
    torch.set_num_threads(default_threads)
    gflops = {k: flops / float(np.median(t)) / 1e9 for k, t in times.items()}
    return {"jax_gflops": gflops["jax"],
            "torch_gflops": max(v for k, v in gflops.items() if k.startswith("torch")),
            "shape": [list(a.shape), list(w.shape)]}


# ---- one size ----
def run(size: str, B: int, T: int, repeats: int) -> dict:
    tmp = tempfile.mkdtemp()
    hf_model = make_checkpoint(tmp, size)
    model, _ = load_pretrained(tmp)
    cfg = TrainConfig(loss=LOSS, mesh=MeshConfig(data=1))
    ts = make_train_step(LOSSES["grpo"], make_optimizer(OPTIM), cfg, model, mesh=make_mesh(cfg.mesh, jax.devices()[:1]))
    state = ts.init_state(model)
    batch = make_batch(B, T, SIZES[size]["vocab_size"])

    # ---- correctness: same log-probs, same loss at identical weights ----
    ours = ts.outputs(state, batch)
    mask = batch.loss_mask.astype(bool)
    # old_logp near a uniform policy's and independent of the weights, so the loss depends on
    # the model's log-probs, ratios differ from 1 and some tokens clip
    noise = np.random.default_rng(1).normal(0.0, 0.3, batch.tokens.shape).astype(np.float32)
    old = (np.asarray(ours.logp).mean(where=mask) + noise) * batch.loss_mask
    batch = batch.replace(old_logp=old, sampler_logp=old)
    with torch.no_grad():
        tlp, _ = torch_outputs(hf_model, torch.from_numpy(batch.tokens).long(),
                               torch.from_numpy(batch.attention_mask).long())
    logp_err = float(np.abs(tlp.numpy()[mask] - np.asarray(ours.logp)[mask]).max())
    torch_step = make_torch_step(hf_model, batch)
    dev_batch = jax.device_put(batch, ts.batch_sharding)
    # XLA:CPU allocates this much scratch per step call (why the malloc setting matters)
    temp_bytes = int(ts.step.lower(state, dev_batch).compile().memory_analysis().temp_size_in_bytes)
    state, metrics = ts.step(state, dev_batch)  # compile + first step
    jax.block_until_ready(state)
    (loss_torch, gnorm_torch), loss_ours, gnorm_ours = torch_step(), float(metrics["loss"]), float(metrics["grad_norm"])
    print(f"[{size}] max |logp_ours - logp_torch| on policy tokens: {logp_err:.2e}; first step: loss ours "
          f"{loss_ours:.6f} torch {loss_torch:.6f}, grad norm ours {gnorm_ours:.6f} torch {gnorm_torch:.6f}")
    if (logp_err > 1e-4 or abs(loss_ours - loss_torch) > 1e-4 * max(1.0, abs(loss_torch))
            or abs(gnorm_ours - gnorm_torch) > 1e-3 * gnorm_torch):
        raise SystemExit("the two sides disagree; refusing to time them")

    # ---- timing: alternate the contenders step by step ----
    # torch runs at its default thread count and at one thread: on a shared, loaded machine
    # OpenMP threads that spin-wait can make the default many times slower, so the headline
    # ratio is taken against the faster of the two (as bench_sampling.py does).
    default_threads = torch.get_num_threads()
    t_ours, t_torch = [], {n: [] for n in sorted({default_threads, 1})}
    ours_faults = 0  # minor page faults during our steps: the malloc setting shows up here
    for _ in range(repeats):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        state, metrics = ts.step(state, dev_batch)
        jax.block_until_ready((state, metrics))
        t_ours.append(time.perf_counter() - t0)
        ours_faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        for n, times in t_torch.items():
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            torch_step()
            times.append(time.perf_counter() - t0)
    torch.set_num_threads(default_threads)
    best = min(t_torch, key=lambda n: np.median(t_torch[n]))
    tokens = int(batch.attention_mask.sum())
    ours_tps, torch_tps = tokens / np.median(t_ours), tokens / np.median(t_torch[best])
    flops, ceiling = step_matmul_flops(size, B, T), gemm_ceiling(size, B, T)
    ours_gflops, torch_gflops = flops / np.median(t_ours) / 1e9, flops / np.median(t_torch[best]) / 1e9
    return {
        "step_matmul_gflop": flops / 1e9, "ours_matmul_gflops": ours_gflops, "torch_matmul_gflops": torch_gflops,
        "gemm_ceiling": ceiling, "ours_share_of_jax_gemm_ceiling": ours_gflops / ceiling["jax_gflops"],
        "torch_share_of_torch_gemm_ceiling": torch_gflops / ceiling["torch_gflops"],
        # what a step 1.5x torch's speed would have to sustain, as a share of JAX's lone-GEMM rate
        "share_of_jax_gemm_ceiling_needed_for_1_5x": 1.5 * torch_gflops / ceiling["jax_gflops"],
        "speedup_vs_torch": ours_tps / torch_tps, "ours_tokens_per_s": ours_tps, "torch_tokens_per_s": torch_tps,
        "ours_step_s_median": float(np.median(t_ours)), "torch_step_s_median": float(np.median(t_torch[best])),
        "torch_best_threads": best,
        "torch_step_s_median_by_threads": {str(n): float(np.median(t)) for n, t in t_torch.items()},
        "batch": B, "seq": T, "real_tokens_per_step": tokens, "repeats": repeats,
        "params": sum(p.numel() for p in hf_model.parameters()), "model": SIZES[size],
        "max_logp_abs_diff": logp_err, "first_loss_ours": loss_ours, "first_loss_torch": loss_torch,
        "first_grad_norm_ours": gnorm_ours, "first_grad_norm_torch": gnorm_torch,
        "xla_temp_bytes_per_step": temp_bytes, "ours_minor_page_faults_per_step": ours_faults / repeats,
    }


# ---- main ----
def default_malloc_run(args) -> dict:
    """The tiny size again in a child process started with glibc's default malloc settings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "default_malloc.json"
        cmd = [sys.executable, __file__, "--malloc", "default", "--sizes", "tiny", "--batch", str(args.batch),
               "--seq", str(args.seq), "--repeats", str(args.repeats), "--out", str(out)]
        subprocess.run(cmd, check=True, env=without_tcmalloc(dict(os.environ)))
        child = json.loads(out.read_text())
    tiny = child["sizes"]["tiny"]
    keys = ("speedup_vs_torch", "ours_step_s_median", "torch_step_s_median", "ours_minor_page_faults_per_step")
    return {"malloc": child["malloc"], **{k: tiny[k] for k in keys}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--sizes", default=",".join(SIZES), help="comma-separated subset of " + ",".join(SIZES))
    ap.add_argument("--malloc", choices=("tcmalloc", "default"), default="tcmalloc",
                    help="tcmalloc: re-exec with tcmalloc preloaded when the machine has it, as the project's "
                         "entry points do (jaxrl_agent/cli/malloc_env.py), then rerun the tiny size with the "
                         "default malloc in a child process for comparison; default: this process as started")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_step.json"))
    args = ap.parse_args()
    if args.malloc == "tcmalloc":
        reexec_with_tcmalloc()  # no-op when already preloaded or not installed
    sizes = args.sizes.split(",")
    if "tiny" not in sizes or any(s not in SIZES for s in sizes):
        raise SystemExit(f"--sizes must include tiny and name only {sorted(SIZES)}, got {args.sizes!r}")
    # the comparison child runs first, while this process holds no memory yet
    default_malloc = default_malloc_run(args) if tcmalloc_active() else None
    rows = {size: run(size, args.batch, args.seq, args.repeats) for size in sizes}
    result = {
        "speedup_vs_torch": rows["tiny"]["speedup_vs_torch"], "sizes": rows, "loss": "grpo seq-mean-token-mean",
        "malloc": "tcmalloc" if tcmalloc_active() else "default",
        "torch_threads": torch.get_num_threads(), "jax": jax.__version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "cpu_count": os.cpu_count(), "machine": platform.machine(),
    }
    if default_malloc is not None:
        result["default_malloc"] = default_malloc
    print(f"{'model':<8}{'params':>10}{'ours step s':>13}{'torch step s':>14}{'ours tok/s':>12}{'torch tok/s':>13}{'speedup':>9}")
    for size, r in rows.items():
        print(f"{size:<8}{r['params']:>10}{r['ours_step_s_median']:>13.4f}{r['torch_step_s_median']:>14.4f}"
              f"{r['ours_tokens_per_s']:>12.0f}{r['torch_tokens_per_s']:>13.0f}{r['speedup_vs_torch']:>8.2f}x")
    print(f"speedup_vs_torch (tiny): {result['speedup_vs_torch']:.2f}x with malloc: {result['malloc']}")
    if "default_malloc" in result:
        d = result["default_malloc"]
        print(f"same tiny step with glibc's default malloc (child process): ours {d['ours_step_s_median']:.4f} s, "
              f"torch {d['torch_step_s_median']:.4f} s, {d['speedup_vs_torch']:.2f}x; minor page faults per step "
              f"of ours: {d['ours_minor_page_faults_per_step']:.0f} (with tcmalloc: "
              f"{rows['tiny']['ours_minor_page_faults_per_step']:.0f})")
    for size, r in rows.items():
        c = r["gemm_ceiling"]
        print(f"[{size}] matmul GFLOP/s: ours {r['ours_matmul_gflops']:.0f} ({r['ours_share_of_jax_gemm_ceiling']:.0%} "
              f"of JAX's lone GEMM, {c['jax_gflops']:.0f}), torch {r['torch_matmul_gflops']:.0f} "
              f"({r['torch_share_of_torch_gemm_ceiling']:.0%} of torch's, {c['torch_gflops']:.0f}); 1.5x torch needs "
              f"{r['share_of_jax_gemm_ceiling_needed_for_1_5x']:.0%} of JAX's")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
