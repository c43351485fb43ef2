"""DEVICE: pure building blocks of the decoder in `model.py`: RMSNorm, RoPE, GQA attention.

Each matches the `transformers` Llama / Qwen numerics: normalisation statistics, attention
scores and softmax in float32; RoPE in the half-split ("rotate_half") layout; query head h
shares kv head h // (H / K). Shapes are written out as explicit broadcasts because the tests
run with `jax_numpy_rank_promotion="raise"`.

Dims: B batch, T queries, S keys, H heads, K kv heads, Dh head dim.
"""
from __future__ import annotations

import math

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


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query softmax attention.

    Args:
      q: `[B, T, H, Dh]`; k, v: `[B, S, K, Dh]` with H % K == 0.
      mask: bool `[B, T, S]`, True where query t may attend to key s.
    Returns:
      `[B, T, H, Dh]` in v's dtype. Scores and softmax in float32.
    """
    b, t, h, dh = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, dh)  # query head h uses kv head h // (H / K), as HF
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(dh)
    s = jnp.where(mask[:, None, None, :, :], s, MASKED)
    w = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", w, v).reshape(b, t, h, dh)
