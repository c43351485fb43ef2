"""HOST: peak memory of per-token log-probs + entropies, chunked vs naive, side by side.

    python benchmarks/bench_logprob_memory.py [--vocab 151936] [--batch 8] [--seq 2048] [--dim 896]

Both paths compute `logp[:, t] = log p(tokens[:, t] | < t)` and the entropy of that
distribution from the final hidden states `[B, T, D]` and the unembedding `[V, D]` (bf16, as a
Qwen2.5-0.5B-sized trainer holds them):
  naive   — `log_softmax(hidden @ W.T)` over the whole `[B, T, V]` float32 logits, then a
            gather: what one writes by default;
  chunked — `logprobs.token_logprobs_and_entropy` (lax.map over chunks of `chunk_size`
            positions of every row, i.e. [B, chunk, V] logits at a time, each chunk
            rematerialised in the backward pass).
Memory is XLA's compiled memory analysis of the jitted function (arguments + outputs +
temporaries - aliased), for the forward pass alone and for forward + backward (gradients
w.r.t. hidden states and unembedding, as in training). Nothing is executed, so the V=151,936,
B*T=8*2048 setting compiles on a laptop CPU. Writes benchmarks/results/logprob_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl_agent.model.logprobs import token_logprobs_and_entropy  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "logprob_memory.json")


def naive(hidden, w, tokens):
    """The default: materialise [B, T, V] float32 logits and their log-softmax."""
    logits = jnp.einsum("btd,vd->btv", hidden, w, preferred_element_type=jnp.float32)
    logp_all = jax.nn.log_softmax(logits, axis=-1)  # [B, T, V] f32
    lp = jnp.take_along_axis(logp_all[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)[:, :-1]
    zero = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([zero, lp], 1), jnp.concatenate([zero, ent], 1)


def chunked(chunk_size):
    return lambda hidden, w, tokens: token_logprobs_and_entropy(hidden, w, tokens, chunk_size=chunk_size)


def with_grad(fn):
    """Forward + backward as in training: a scalar of logp and entropy, grads w.r.t. both inputs."""
    def loss(hidden, w, tokens):
        lp, ent = fn(hidden, w, tokens)
        return jnp.sum(lp) + 0.01 * jnp.sum(ent)
    return jax.grad(loss, argnums=(0, 1))


def peak_bytes(fn, *args) -> dict:
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
             - stats.alias_size_in_bytes)
    return {"peak_bytes": int(total), "temp_bytes": int(stats.temp_size_in_bytes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=896)
    ap.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()

    b, t, d, v = args.batch, args.seq, args.dim, args.vocab
    hidden = jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((v, d), jnp.bfloat16)
    tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)

    rows = []
    for mode, wrap in (("forward", lambda f: f), ("forward+backward", with_grad)):
        ref = peak_bytes(wrap(naive), hidden, w, tokens)
        rows.append({"mode": mode, "path": "naive", **ref, "ratio_to_naive": 1.0})
        for c in args.chunks:
            m = peak_bytes(wrap(chunked(c)), hidden, w, tokens)
            rows.append({"mode": mode, "path": f"chunked(chunk_size={c})", **m,
                         "ratio_to_naive": m["peak_bytes"] / ref["peak_bytes"]})

    print(f"per-token logp + entropy, V={v}, B*T={b}*{t}, D={d}, bf16 inputs, backend={jax.default_backend()}")
    print(f"{'mode':<18}{'path':<28}{'peak GiB':>10}{'temp GiB':>10}{'ratio':>8}")
    for r in rows:
        print(f"{r['mode']:<18}{r['path']:<28}{r['peak_bytes'] / 2**30:>10.3f}{r['temp_bytes'] / 2**30:>10.3f}"
              f"{r['ratio_to_naive']:>8.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({
            "setting": {"vocab": v, "batch": b, "seq": t, "dim": d, "dtype": "bfloat16"},
            "backend": jax.default_backend(), "jax": jax.__version__, "machine": platform.machine(),
            "method": "jax.jit(f).lower(...).compile().memory_analysis(): argument + output + temp - alias",
            "rows": rows,
        }, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
