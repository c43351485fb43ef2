"""DEVICE: the fixed-size key/value cache used by the cached decoding path of `model.CausalLM`.

A cache is a pytree of arrays with static shapes, so a jitted sampler can carry it through
`lax.while_loop` without recompiling:

    k, v     [L, B, S, K, Dh]   keys / values of every layer, slot s of row b
    lengths  [B] int32          number of filled slots of each row

Rows are compact: row b holds its tokens in slots `0 .. lengths[b] - 1` and the token in slot
s has RoPE position s. Appending `n` tokens to a row writes slots `lengths[b] .. lengths[b] + n
- 1` and advances `lengths[b]` by `n`, so rows of different lengths advance independently (a
right-padded prefill chunk writes garbage into slots past the new length; those slots are never
attended to and are overwritten by the next append). Everything is functional: an update
returns a new cache.

Writes past the capacity S are dropped (XLA cannot raise inside a jitted loop): the sampler
must size S for prompt + generation budget, which `check_capacity` verifies on the host.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


# Logical axis names of k / v and lengths, for `sharding.py` to map onto a mesh.
KV_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
LENGTHS_AXES = ("batch",)


@struct.dataclass
class KVCache:
    """Keys, values and per-row fill lengths (see module docstring for shapes)."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        """S, the number of slots per row."""
        return self.k.shape[2]


def init_cache(
    num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
    dtype=jnp.float32,
) -> KVCache:
    """An empty cache: k, v zeros `[L, B, S, K, Dh]` of `dtype`, lengths zeros `[B]` int32."""
    shape = (num_layers, batch_size, max_len, num_kv_heads, head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    )


def append_slots(lengths: jax.Array, num_new: int) -> jax.Array:
    """Cache slot (== RoPE position) of each appended token.

    Args:
      lengths: int32 `[B]` current fill lengths.
      num_new: T, the chunk length (static).
    Returns:
      int32 `[B, T]`: `lengths[b] + t`.
    """
    return lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]


def write_layer(cache_kv: jax.Array, layer: int | jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """Scatter one layer's new keys (or values) into the stacked cache array.

    Args:
      cache_kv: `[L, B, S, K, Dh]` keys or values of all layers.
      layer: layer index, a Python int (unrolled layers) or an int32 scalar (layer scan).
      slots: int32 `[B, T]` target slot of each new token (`append_slots`).
      new: `[B, T, K, Dh]` the new keys or values.
    Returns:
      The updated `[L, B, S, K, Dh]` array. Out-of-range slots are dropped rather than clamped:
      `dynamic_update_slice` would clamp the start and silently overwrite valid slots.
    """
    batch = jnp.broadcast_to(jnp.arange(slots.shape[0], dtype=jnp.int32)[:, None], slots.shape)
    return cache_kv.at[layer, batch, slots].set(new.astype(cache_kv.dtype), mode="drop")


def cached_attention_mask(slots: jax.Array, capacity: int) -> jax.Array:
    """Boolean `[B, T, S]` mask: the query in slot `slots[b, t]` sees cache slots `s <= slot`.

    Because rows are compact and a chunk's valid tokens come first, every slot at or before a
    valid query's slot holds a real token of that row; queries at padded chunk positions get
    garbage outputs that nobody reads.
    """
    s = jnp.arange(capacity, dtype=jnp.int32)
    return s[None, None, :] <= slots[:, :, None]


def check_capacity(cache: KVCache, num_new: int) -> None:
    """HOST: raise a ValueError if appending `num_new` tokens to any row would overflow S."""
    longest = int(np.max(np.asarray(cache.lengths))) if cache.lengths.size else 0
    if longest + num_new > cache.capacity:
        raise ValueError(
            f"KV cache overflow: a row holds {longest} tokens, appending {num_new} needs "
            f"{longest + num_new} slots but the cache has S={cache.capacity}"
        )
