"""DEVICE: the fixed-size key/value cache used by the cached decoding path of `model.CausalLM`.

A cache is a pytree of arrays with static shapes, so a jitted sampler can carry it through
`lax.while_loop` without recompiling:

    k        L arrays [B, K, Dh, S]  (per_layer)   keys of each layer, kv head k, slot s of
             or one   [L, B, K, Dh, S] (stacked)  row b: slots last
    v        L arrays [B, K, S, Dh]  (per_layer)   values, the same with slots before Dh
             or one   [L, B, K, S, Dh] (stacked)
    lengths  [B] int32                            number of filled slots of each row

Two storage forms, matching how the model runs its layers. A model whose layers are unrolled
(shallow, CPU) keeps one array per layer, so each layer's attention multiplies its own buffer
in place; a model that scans its layers (deep) keeps one stacked array, which the scan slices
per layer. Heads come before slots, and keys keep their slots last, because those are the
layouts attention multiplies in: scores are `q [.., Dh] @ k [Dh, S]` and outputs are
`p [.., S] @ v [S, Dh]`, both plain row-major GEMMs. These choices keep XLA:CPU from copying
or transposing the cache every decode step: slots first, it transposed each layer's cache
before attention; with keys `[S, Dh]`, the decode scores matmul took 94 µs per layer against
43 µs now (`benchmarks/profile_decode.py`); stacked and unrolled, it copied each layer's slice
out of the stack.

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

# Logical axis names of one layer's keys and values, and of lengths (the stacked form adds a
# leading "layers"); for a sharded sampler's rules table.
K_LAYER_AXES = ("batch", "kv_heads", "head_dim", "cache_seq")
V_LAYER_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")
LENGTHS_AXES = ("batch",)


@struct.dataclass
class KVCache:
    """Keys, values and per-row fill lengths (see module docstring for the two forms)."""

    k: jax.Array | tuple[jax.Array, ...]  # [.., B, K, Dh, S]
    v: jax.Array | tuple[jax.Array, ...]  # [.., B, K, S, Dh]
    lengths: jax.Array

    @property
    def per_layer(self) -> bool:
        """True when k / v are tuples of per-layer arrays (`[B, K, Dh, S]` / `[B, K, S, Dh]`)."""
        return isinstance(self.k, (tuple, list))

    @property
    def capacity(self) -> int:
        """S, the number of slots per row."""
        return (self.v[0] if self.per_layer else self.v).shape[-2]


def init_cache(
    num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
    dtype=jnp.float32, *, per_layer: bool = False,
) -> KVCache:
    """An empty cache: k, v zeros of `dtype` (L arrays `[B, K, Dh, S]` / `[B, K, S, Dh]` if
    `per_layer`, else one `[L, B, K, Dh, S]` / `[L, B, K, S, Dh]`), lengths zeros `[B]` int32."""
    k_shape = (batch_size, num_kv_heads, head_dim, max_len)
    v_shape = (batch_size, num_kv_heads, max_len, head_dim)
    if per_layer:
        k = tuple(jnp.zeros(k_shape, dtype) for _ in range(num_layers))
        v = tuple(jnp.zeros(v_shape, dtype) for _ in range(num_layers))
    else:
        k, v = jnp.zeros((num_layers,) + k_shape, dtype), jnp.zeros((num_layers,) + v_shape, dtype)
    return KVCache(k=k, v=v, lengths=jnp.zeros((batch_size,), jnp.int32))


def append_slots(lengths: jax.Array, num_new: int) -> jax.Array:
    """Cache slot (== RoPE position) of each appended token.

    Args:
      lengths: int32 `[B]` current fill lengths.
      num_new: T, the chunk length (static).
    Returns:
      int32 `[B, T]`: `lengths[b] + t`.
    """
    return lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]


def write_slots(layer_kv: jax.Array, slots: jax.Array, new: jax.Array, layer: jax.Array | None = None,
                *, slots_last: bool = False) -> jax.Array:
    """Scatter new keys (or values) into one layer's cache, or into the stacked cache.

    Args:
      layer_kv: `[B, K, S, Dh]` one layer's values (`[B, K, Dh, S]` keys with `slots_last`),
        or the stacked `[L, ...]` form with `layer`.
      slots: int32 `[B, T]` target slot of each new token (`append_slots`).
      new: `[B, T, K, Dh]` the new keys or values.
      layer: int32 scalar, the layer to write in a stacked cache (None for one layer's array).
      slots_last: the cache holds slots on its last axis (the keys' layout).
    Returns:
      The updated array, same shape. Out-of-range slots are dropped rather than clamped:
      `dynamic_update_slice` would clamp the start and silently overwrite valid slots.
    """
    batch = jnp.broadcast_to(jnp.arange(slots.shape[0], dtype=jnp.int32)[:, None], slots.shape)
    # Advanced indices split by slices: NumPy rules put their broadcast [B, T] first, so the
    # indexed view is [B, T, K, Dh], like `new`, in both layouts.
    index = (batch, slice(None), slice(None), slots) if slots_last else (batch, slice(None), slots)
    index = index if layer is None else (layer,) + index
    return layer_kv.at[index].set(new.astype(layer_kv.dtype), mode="drop")


def window(cache: KVCache, w: int, rows: jax.Array | None = None) -> KVCache:
    """The first `w` slots (static `w <= S`) of rows `rows` `[R]` (all rows when None): a cache
    of R rows and capacity w, copied once.

    The decode loop runs on this view while every live row's length stays below w, so each
    step's attention reads w slots without slicing (and copying) the full cache per step, and
    runs on the R rows that decode rather than all B; `put_window` writes the view back when
    the loop ends.
    """
    if rows is None and w >= cache.capacity:
        return cache
    k_at, v_at = _window_index(cache, w, rows)
    k = tuple(a[k_at] for a in cache.k) if cache.per_layer else cache.k[k_at]
    v = tuple(a[v_at] for a in cache.v) if cache.per_layer else cache.v[v_at]
    return KVCache(k=k, v=v, lengths=cache.lengths if rows is None else cache.lengths[rows])


def put_window(cache: KVCache, view: KVCache, rows: jax.Array | None = None) -> KVCache:
    """`cache` with the first `view.capacity` slots and the lengths of rows `rows` (distinct;
    all rows when None) replaced by `view`'s."""
    w = view.capacity
    if rows is None and w >= cache.capacity:
        return view
    k_at, v_at = _window_index(cache, w, rows)
    k = tuple(a.at[k_at].set(b) for a, b in zip(cache.k, view.k)) if cache.per_layer else cache.k.at[k_at].set(view.k)
    v = tuple(a.at[v_at].set(b) for a, b in zip(cache.v, view.v)) if cache.per_layer else cache.v.at[v_at].set(view.v)
    return KVCache(k=k, v=v, lengths=view.lengths if rows is None else cache.lengths.at[rows].set(view.lengths))


def _window_index(cache: KVCache, w: int, rows: jax.Array | None) -> tuple[tuple, tuple]:
    """Index tuples of (rows, first w slots) into one key array and one value array."""
    r, all_ = slice(None) if rows is None else rows, slice(None)
    k_at, v_at = (r, all_, all_, slice(0, w)), (r, all_, slice(0, w), all_)  # keys: slots last
    if not cache.per_layer:  # stacked [L, B, ...]
        k_at, v_at = (all_, *k_at), (all_, *v_at)
    return k_at, v_at


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
