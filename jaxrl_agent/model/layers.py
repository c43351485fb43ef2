"""DEVICE: pure building blocks of the decoder in `decoder.py`: RMSNorm, RoPE, GQA attention,
dense projections.

Each matches the `transformers` Llama / Qwen numerics: normalisation statistics, attention
scores and softmax in float32; RoPE in the half-split ("rotate_half") layout; query head h
shares kv head h // (H / K). Shapes are written out as explicit broadcasts because the tests
run with `jax_numpy_rank_promotion="raise"`.

Dims: B batch, T queries, S keys, H heads, K kv heads, Dh head dim.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

MASKED = -1e30  # finite, so a query with no visible key gets a uniform (not NaN) softmax


def lead_axes(w: jax.Array, ndim: int) -> jax.Array:
    """Prepend unit axes so `w` broadcasts explicitly (the tests forbid rank promotion)."""
    return w.reshape((1,) * (ndim - w.ndim) + w.shape)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, statistics in float32, as `transformers` does.

    Args: x `[..., N]`, weight `[N]`. Returns `[..., N]` in x's dtype.
    """
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return lead_axes(weight, x.ndim) * x32.astype(x.dtype)


def rope_inv_freq(cfg) -> jax.Array:
    """Inverse RoPE frequencies `[Dh / 2]` float32 (Llama-3 scaled when rope_type == llama3).

    Args: cfg, a `model.ModelConfig` (head_dim and the rope_* fields are read).
    """
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim))
    if cfg.rope_type == "default":
        return inv
    if cfg.rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {cfg.rope_type!r} (supported: default, llama3)")
    # Llama-3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    low_wl = cfg.rope_original_max_position / cfg.rope_low_freq_factor
    high_wl = cfg.rope_original_max_position / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wl, inv / cfg.rope_factor, inv)
    smooth = (cfg.rope_original_max_position / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    blended = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return jnp.where(medium, blended, scaled)


def rope_tables(inv_freq: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[B, T, Dh]` float32 for int positions `[B, T]` (half-split layout of HF)."""
    freqs = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `[B, T, N, Dh]` by cos/sin `[B, T, Dh]` (rotate_half convention, x's dtype)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, causal: bool = False,
              cache_layout: bool = False) -> jax.Array:
    """Grouped-query softmax attention.

    Args:
      q: `[B, T, H, Dh]`; k, v: `[B, S, K, Dh]` with H % K == 0, or, with `cache_layout`,
        k `[B, K, Dh, S]` and v `[B, K, S, Dh]` (the KV cache's layouts, so decoding never
        transposes the cache).
      mask: bool `[B, T, S]`, True where query t may attend to key s.
      causal: promise that the last T keys are the queries' own, in order, and mask[b, t, s]
        is False for s > S - T + t (static; S == T is plain causal attention, S > T puts a
        prefix of S - T keys before them). Queries then run in blocks and block i skips the
        keys after its last query, which mask hides anyway.
    Returns:
      `[B, T, H, Dh]` in v's dtype. Scores and softmax in float32.

    Layout: query head h uses kv head h // G (G = H / K), as HF. The G query heads of a kv
    head are folded into the matmul rows, `[B, K, G*T, Dh] x [B, K, S, Dh]`, so k / v are never
    repeated, and both matmuls have their batch dims leading (XLA:CPU then needs no transposes
    of the `[.., T, S]` scores in the forward or backward pass). q is scaled before the
    product (T*Dh multiplies instead of T*S).
    """
    b, t, h, dh = q.shape
    if cache_layout:
        k_eq = "bkqd,bkds->bkqs"  # keys [B, K, Dh, S]
    else:
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, Dh]
        k_eq = "bkqd,bksd->bkqs"
    kv, s_len = v.shape[1], v.shape[2]
    g = h // kv
    if causal and s_len < t:
        raise ValueError(f"causal attention needs S >= T, got q {q.shape}, k {k.shape}")
    before = s_len - t if causal else 0  # keys ahead of the queries' own (a shared prefix)
    q = (q * (1.0 / math.sqrt(dh))).reshape(b, t, kv, g, dh).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, Dh]
    # Causal blocks: with C queries per block, block i needs keys [0, (i + 1) * C) only, which
    # skips ~half of the score work and keeps each block's scores small (the train step's time
    # is measured in benchmarks/bench_train_step.py).
    c = max(64, -(-t // 8)) if causal else t
    outs = []
    # split, not slices: its transpose is one concatenate, where slices would each pad to the
    # full [B, K, G, T, Dh] in the backward pass and add the pads up.
    for start, qi in zip(range(0, t, c), jnp.split(q, list(range(c, t, c)), axis=3)):
        stop = min(start + c, t)
        n = before + stop if causal else s_len  # keys this block can see
        rows = stop - start
        qi = qi.reshape(b, kv, g * rows, dh)
        k_n = k[..., :n] if cache_layout else k[:, :, :n]
        if causal and not cache_layout:  # training: the backward recomputes the softmax
            o = _block_attention(qi, k_n, v[:, :, :n], mask[:, start:stop, :n], g)
        else:
            s = jnp.where(mask[:, None, None, start:stop, :n], _block_scores(qi, k_n, g, k_eq), MASKED)
            w = jax.nn.softmax(s, axis=-1).astype(v.dtype).reshape(b, kv, g * rows, n)
            o = jnp.einsum("bkqs,bksd->bkqd", w, v[:, :, :n])
        outs.append(o.reshape(b, kv, g, rows, dh))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)  # [B, K, G, T, Dh]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)


def _block_scores(qi: jax.Array, k_n: jax.Array, g: int, k_eq: str = "bkqd,bksd->bkqs") -> jax.Array:
    """float32 scores `[B, K, G, R, N]` of one query block `qi` `[B, K, G*R, Dh]` (pre-scaled)."""
    b, kv, gr, _ = qi.shape
    s = jnp.einsum(k_eq, qi, k_n, preferred_element_type=jnp.float32)
    return s.reshape(b, kv, g, gr // g, s.shape[-1])


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _block_attention(qi: jax.Array, k_n: jax.Array, v_n: jax.Array, mask: jax.Array, g: int) -> jax.Array:
    """One causal query block: `softmax(mask(qi k_n^T)) v_n`, with a backward pass written to
    keep only the block's log-sum-exp and recompute the probabilities.

    Math (per query row, scores s, probabilities p = exp(s - lse), output o = p v, incoming
    gradient do): dv = p^T do, dp = do v^T, ds = p * (dp - rowsum(do * o)), dq = ds k,
    dk = ds^T q (the softmax backward of FlashAttention, Dao et al. 2022, appendix B.2,
    without the tiling). Autodiff of the plain softmax keeps p, and XLA:CPU also
    keeps its other score-sized intermediates: the train step's scratch held every block's
    `[B, K, G, R, N]` scores several times over (benchmarks/bench_train_step.py reports
    `xla_temp_bytes_per_step`). tests/test_attention_causal.py checks both against autodiff.

    What XLA:CPU makes of it: it merges the recomputed p with the forward pass's identical p
    (common subexpressions; an optimization barrier stops the merge but not its scheduler
    running the recompute in the forward pass), so p is kept after all, and the other
    intermediates are not. Making the recompute wait for `do` (a data dependency) did free
    p, at about a sixth more step time for the agent update: not done; `ModelConfig.remat`
    is the memory setting (benchmarks/update_cost.py [--remat]).

    Args: qi `[B, K, G*R, Dh]` scaled queries; k_n, v_n `[B, K, N, Dh]`; mask bool `[B, R, N]`;
    g query heads per kv head (static). Returns `[B, K, G*R, Dh]` in v's dtype.
    """
    return _block_forward(qi, k_n, v_n, mask, g)[0]


def _block_forward(qi, k_n, v_n, mask, g):
    s = jnp.where(mask[:, None, None], _block_scores(qi, k_n, g), MASKED)
    lse = jax.nn.logsumexp(s, axis=-1, keepdims=True)  # [B, K, G, R, 1]
    p = jnp.exp(s - lse).astype(v_n.dtype).reshape(*qi.shape[:3], k_n.shape[2])
    o = jnp.einsum("bkqs,bksd->bkqd", p, v_n)
    return o, (qi, k_n, v_n, mask, o, lse)


def _block_backward(g, res, do):
    qi, k_n, v_n, mask, o, lse = res
    f32 = jnp.float32
    s = jnp.where(mask[:, None, None], _block_scores(qi, k_n, g), MASKED)
    p = jnp.exp(s - lse).reshape(*qi.shape[:3], k_n.shape[2])  # [B, K, G*R, N] float32
    do = do.astype(f32)
    dv = jnp.einsum("bkqs,bkqd->bksd", p, do)
    dp = jnp.einsum("bkqd,bksd->bkqs", do, v_n.astype(f32))
    ds = p * (dp - jnp.sum(do * o.astype(f32), axis=-1, keepdims=True))
    dq = jnp.einsum("bkqs,bksd->bkqd", ds, k_n.astype(f32))
    dk = jnp.einsum("bkqs,bkqd->bksd", ds, qi.astype(f32))
    return dq.astype(qi.dtype), dk.astype(k_n.dtype), dv.astype(v_n.dtype), None


_block_attention.defvjp(_block_forward, _block_backward)


def dense(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """Contract the last `n_in` axes of x with the leading ones of w, as one 2-D matmul.

    Args: x `[..., *in]`, w `[*in, *out]`. Returns `[..., *out]` in x's dtype.
    Why 2-D: on XLA:CPU the gradient of a batched einsum such as `btd,df->btf` materialises
    transposes of the `[B, T, F]` activations; `[B*T, in] @ [in, out]` differentiates into
    two plain GEMMs (benchmarks/bench_train_step.py times the step built on it).
    """
    ins, outs = w.shape[:n_in], w.shape[n_in:]
    lead = x.shape[: x.ndim - n_in]
    y = x.reshape(-1, math.prod(ins)) @ w.reshape(math.prod(ins), math.prod(outs))
    return y.reshape(*lead, *outs)
