"""DEVICE: the Flax NNX decoder policy for the Llama-3 / Qwen2 / Qwen3 family.

One module covers the three families (DESIGN §5; building blocks in `layers.py`): RMSNorm, RoPE (plain or Llama-3 scaled),
grouped-query attention, SwiGLU MLP, tied or untied embeddings, optional q/k/v biases (Qwen2),
optional per-head q/k RMSNorm (Qwen3), and an optional scalar value head (critic).

Layer weights are stacked along a leading `layers` axis: shallow models apply them in an
unrolled loop (faster on CPU), deep ones with `lax.scan` so compile time does not grow with
depth (`ModelConfig.unroll_layers`). Every parameter carries logical axis names (`vocab`,
`embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `layers`) as NNX `out_sharding` metadata;
only `train/sharding.py` maps them to mesh axes.

Numerics follow `transformers`: norms, softmax and logits in float32, everything else in the
parameter dtype. The per-token log-prob / entropy kernels are in `logprobs.py`;
`outputs.policy_outputs` scores a batch through them without a `[B, T, V]` log-softmax.

Dims: B batch, T tokens, S cache slots, D model, H heads, K kv heads, Dh head dim, F MLP, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_agent.model import kv_cache
from jaxrl_agent.model.kv_cache import KVCache
from jaxrl_agent.model.layers import apply_rope, attention, dense, lead_axes, rms_norm, rope_inv_freq, rope_tables

__all__ = ["ModelConfig", "CausalLM"]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder; `hf.py` maps HF `config.json` files to and from it."""

    vocab_size: int
    """V, rows of the embedding table."""
    hidden_size: int
    """D, the residual stream width."""
    intermediate_size: int
    """F, the SwiGLU hidden width."""
    num_layers: int
    """L, number of decoder blocks."""
    num_heads: int
    """H, query heads."""
    num_kv_heads: int
    """K, key/value heads (H % K == 0; K == H is plain multi-head attention)."""
    head_dim: int
    """Dh, per-head width (Qwen3 decouples it from D / H)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_type: str = "default"
    """"default" or "llama3" (Llama-3.1 frequency scaling with the `rope_*` fields below)."""
    rope_factor: float = 8.0
    """llama3 rope scaling: overall factor."""
    rope_low_freq_factor: float = 1.0
    """llama3 rope scaling: low-frequency factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 rope scaling: high-frequency factor."""
    rope_original_max_position: int = 8192
    """llama3 rope scaling: context length of the unscaled model."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    tie_word_embeddings: bool = False
    """Unembedding reuses the input embedding table."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2; Llama with attention_bias)."""
    o_bias: bool = False
    """Bias on the attention output projection (Llama / Qwen3 with attention_bias)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    value_head: bool = False
    """Add a scalar value head (critic) on the final hidden states."""
    remat: bool = False
    """Rematerialise each block in the backward pass (saves activation memory); the full
    forward then scans its layers however few there are (decoder._layers says why)."""
    unroll_layers: int = 8
    """Models with at most this many layers apply them in an unrolled loop (faster on CPU);
    deeper ones use `lax.scan`, whose compile time does not grow with depth."""
    architecture: str = "LlamaForCausalLM"
    """HF architecture name written back by `hf.save_pretrained`."""
    max_position_embeddings: int = 32768
    """Context length recorded in the exported config (not enforced)."""
    bos_token_id: int | None = None
    """Recorded in the exported config."""
    eos_token_id: int | tuple[int, ...] | None = None
    """Recorded in the exported config (generation stops on these)."""


# ---- the module ----------------------------------------------------------------------------

# name -> (shape builder, logical axes, init kind); layer weights get a leading `layers` axis.
def _param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], str]]:
    d, f, h, k, dh, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    specs = {
        "embed": ((cfg.vocab_size, d), ("vocab", "embed"), "normal"),
        "final_norm": ((d,), ("embed",), "ones"),
        "attn_norm": ((L, d), ("layers", "embed"), "ones"),
        "wq": ((L, d, h, dh), ("layers", "embed", "heads", "head_dim"), "normal"),
        "wk": ((L, d, k, dh), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "wv": ((L, d, k, dh), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "wo": ((L, h, dh, d), ("layers", "heads", "head_dim", "embed"), "normal"),
        "mlp_norm": ((L, d), ("layers", "embed"), "ones"),
        "w_gate": ((L, d, f), ("layers", "embed", "mlp"), "normal"),
        "w_up": ((L, d, f), ("layers", "embed", "mlp"), "normal"),
        "w_down": ((L, f, d), ("layers", "mlp", "embed"), "normal"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ((cfg.vocab_size, d), ("vocab", "embed"), "normal")
    if cfg.qkv_bias:
        specs["bq"] = ((L, h, dh), ("layers", "heads", "head_dim"), "zeros")
        specs["bk"] = ((L, k, dh), ("layers", "kv_heads", "head_dim"), "zeros")
        specs["bv"] = ((L, k, dh), ("layers", "kv_heads", "head_dim"), "zeros")
    if cfg.o_bias:
        specs["bo"] = ((L, d), ("layers", "embed"), "zeros")
    if cfg.qk_norm:
        specs["q_norm"] = ((L, dh), ("layers", "head_dim"), "ones")
        specs["k_norm"] = ((L, dh), ("layers", "head_dim"), "ones")
    if cfg.value_head:
        specs["value_w"] = ((d,), ("embed",), "zeros")  # zero init: the critic starts at V = 0
        specs["value_b"] = ((), (), "zeros")
    return specs


_GLOBAL = ("embed", "final_norm", "lm_head", "value_w", "value_b")  # not stacked over layers


class CausalLM(nnx.Module):
    """Decoder-only LM policy; parameters are `nnx.Param`s named as in `_param_specs`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, init_std: float = 0.02):
        """Random init (normal(init_std) matrices, unit norms, zero biases) in `dtype`."""
        if config.num_heads % config.num_kv_heads:
            raise ValueError(f"num_heads={config.num_heads} is not a multiple of num_kv_heads={config.num_kv_heads}")
        self.config = config
        for name, (shape, axes, kind) in _param_specs(config).items():
            if kind == "normal":
                value = init_std * jax.random.normal(rngs.params(), shape, jnp.float32)
            else:
                value = jnp.ones(shape, jnp.float32) if kind == "ones" else jnp.zeros(shape, jnp.float32)
            setattr(self, name, nnx.Param(value.astype(dtype), out_sharding=axes, eager_sharding=False))

    # ---- pieces shared by the full and the cached path ----

    def _get(self, name: str) -> jax.Array | None:
        p = getattr(self, name, None)
        return None if p is None else p[...]

    def _layer_params(self) -> dict[str, jax.Array]:
        names = [n for n in _param_specs(self.config) if n not in _GLOBAL]
        return {n: self._get(n) for n in names}

    def _qkv(self, p, x, cos, sin):
        cfg = self.config
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        q, k, v = dense(h, p["wq"]), dense(h, p["wk"]), dense(h, p["wv"])  # [B, T, H | K, Dh]
        if cfg.qkv_bias:
            q, k, v = q + lead_axes(p["bq"], 4), k + lead_axes(p["bk"], 4), v + lead_axes(p["bv"], 4)
        if cfg.qk_norm:
            q, k = rms_norm(q, p["q_norm"], cfg.rms_norm_eps), rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish_block(self, p, x, attn):
        cfg = self.config
        out = dense(attn, p["wo"], n_in=2)  # [B, T, D]
        x = x + (out + lead_axes(p["bo"], 3) if cfg.o_bias else out)
        h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        gate = jax.nn.silu(dense(h, p["w_gate"]))  # [B, T, F]
        return x + dense(gate * dense(h, p["w_up"]), p["w_down"])

    def _layers(self, body, carry, *, hoist: bool = False):
        """Apply `body(carry, p, layer) -> carry` over the layers; p holds layer `layer`'s weights.

        Up to `unroll_layers` layers run as a Python loop over slices of the stacked arrays,
        `layer` a Python int: on CPU faster than `lax.scan` (no loop-carried buffers, XLA fuses
        across layer boundaries, static cache slices; benchmarks/bench_train_step.py). Deeper models scan (`layer`
        traced) so compile time stays flat. `hoist` (cached path): each layer's weight slices
        pass an optimization barrier, which XLA's while-loop invariant code motion hoists out
        of a sampler's decode loop together with the slice; a lone slice is "not worth
        hoisting", so every decode step would copy all weights (benchmarks/profile_decode.py
        shows a decode step's copies).
        """
        stacked = self._layer_params()
        # remat scans the layers, whatever the depth: in an unrolled loop XLA may merge a
        # rematerialised block with the forward pass's copy or run it ahead of the backward
        # pass, and then keeps the activations anyway (on XLA:CPU more scratch than without
        # remat; tests/test_model.py::test_remat_keeps_less_for_the_backward_pass). The scan's
        # loop orders each layer's recompute after its gradient. The cached path (sampling)
        # takes no gradient and keeps its layout.
        remat = self.config.remat and not hoist
        if remat:
            body = jax.checkpoint(body, prevent_cse=False)
        if remat or not self._unrolled():
            ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
            return jax.lax.scan(lambda c, xs: (body(c, *xs), None), carry, (stacked, ids))[0]
        for i in range(self.config.num_layers):
            p = {name: w[i] for name, w in stacked.items()}
            carry = body(carry, jax.lax.optimization_barrier(p) if hoist else p, i)
        return carry

    def _unrolled(self) -> bool:
        return self.config.num_layers <= self.config.unroll_layers

    # ---- full forward (training, scoring) ----

    def hidden_states(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                      prefix: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
        """Final normed hidden states `[B, T, D]` (param dtype) of a padded batch, no cache.

        Args: tokens, positions int32 `[B, T]`; attention_mask `[B, T]`, 1 on real tokens
        (or segment ids 1, 2, ... for rows packed with several sequences, 0 on padding).
        Query t attends to keys j <= t (by index) with attention_mask > 0 and, for packed
        rows, the same segment id, so left, right and in-between padding all work; outputs at
        padded positions are finite garbage.
          prefix: optional (prefix_tokens int32 `[P, Tp]`, prefix_mask `[P, Tp]` 1 on real
        tokens, prefix_index int32 `[B]`), as in `TrainBatch`: row b continues the real tokens
        of prefix `prefix_index[b]`, which every query of the row also sees (positions are
        the caller's: a row's continue from its prefix's length). Each prefix runs through the
        layers once, however many rows continue it; its keys and values are gathered per
        row, so the hidden states equal those of the rows written out whole.
        """
        if tokens.ndim != 2 or positions.shape != tokens.shape or attention_mask.shape != tokens.shape:
            raise ValueError(
                f"tokens {tokens.shape}, positions {positions.shape}, attention_mask "
                f"{attention_mask.shape} must all be [B, T]"
            )
        t = tokens.shape[1]
        x = self._get("embed")[tokens]  # [B, T, D]
        inv_freq = rope_inv_freq(self.config)
        cos, sin = rope_tables(inv_freq, positions)
        idx = jnp.arange(t)
        seg_q, seg_k = attention_mask[:, :, None], attention_mask[:, None, :]
        # Packed rows number their segments 1, 2, ... in attention_mask: a real query sees only
        # keys of its own segment. For 0/1 masks this is the plain padding mask.
        same = (seg_k == seg_q) | (seg_q == 0)
        mask = (idx[None, None, :] <= idx[None, :, None]) & (seg_k > 0) & same  # [B, T, T]
        if prefix is None:
            def body(x, p, layer):
                q, k, v = self._qkv(p, x, cos, sin)
                return self._finish_block(p, x, attention(q, k, v, mask, causal=True))

            x = self._layers(body, x)
            return rms_norm(x, self._get("final_norm"), self.config.rms_norm_eps)

        prefix_tokens, prefix_mask, prefix_index = prefix
        if prefix_tokens.ndim != 2 or prefix_mask.shape != prefix_tokens.shape or prefix_index.shape != tokens.shape[:1]:
            raise ValueError(f"prefix_tokens {prefix_tokens.shape}, prefix_mask {prefix_mask.shape} must be [P, Tp] "
                             f"and prefix_index {prefix_index.shape} [B={tokens.shape[0]}]")
        tp = prefix_tokens.shape[1]
        p_idx = jnp.arange(tp)
        p_cos, p_sin = rope_tables(inv_freq, jnp.broadcast_to(p_idx, prefix_tokens.shape))
        p_mask = (p_idx[None, None, :] <= p_idx[None, :, None]) & (prefix_mask[:, None, :] > 0)  # [P, Tp, Tp]
        seen = jnp.broadcast_to(prefix_mask[prefix_index][:, None, :] > 0, (tokens.shape[0], t, tp))
        row_mask = jnp.concatenate([seen, mask], axis=2)  # [B, T, Tp + T]: the prefix, then the row

        def body(carry, p, layer):
            xp, x = carry
            qp, kp, vp = self._qkv(p, xp, p_cos, p_sin)  # [P, Tp, ...]
            q, k, v = self._qkv(p, x, cos, sin)
            k = jnp.concatenate([kp[prefix_index], k], axis=1)  # [B, Tp + T, K, Dh]
            v = jnp.concatenate([vp[prefix_index], v], axis=1)
            # The last layer's prefix block feeds nothing; XLA drops it when the layers unroll.
            xp = self._finish_block(p, xp, attention(qp, kp, vp, p_mask, causal=True))
            return xp, self._finish_block(p, x, attention(q, k, v, row_mask, causal=True))

        _, x = self._layers(body, (self._get("embed")[prefix_tokens], x))
        return rms_norm(x, self._get("final_norm"), self.config.rms_norm_eps)

    def unembedding(self) -> jax.Array:
        """The output embedding `[V, D]` (the input table when embeddings are tied)."""
        return self._get("embed") if self.config.tie_word_embeddings else self._get("lm_head")

    def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
        """`[..., D]` hidden states -> `[..., V]` float32 logits."""
        return jnp.einsum("...d,vd->...v", hidden, self.unembedding(), preferred_element_type=jnp.float32)

    def values_from_hidden(self, hidden: jax.Array) -> jax.Array:
        """Value head: `[B, T, D]` -> float32 `[B, T]`, `values[:, t]` read at position t."""
        if not self.config.value_head:
            raise ValueError("this model has no value head (ModelConfig.value_head=False)")
        w = self._get("value_w").astype(jnp.float32)
        return jnp.einsum("btd,d->bt", hidden.astype(jnp.float32), w) + self._get("value_b").astype(jnp.float32)

    def __call__(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """Full-sequence logits: int32 `[B, T]` inputs -> float32 `[B, T, V]` (DESIGN §11)."""
        return self.logits_from_hidden(self.hidden_states(tokens, positions, attention_mask))

    # ---- cached path (sampling) ----

    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
        """An empty `KVCache` with S = max_len slots per row (dtype defaults to the params'); one
        array per layer when the layers are unrolled, one stacked array when they are scanned."""
        cfg = self.config
        dtype = dtype or self._get("embed").dtype
        return kv_cache.init_cache(cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim, dtype,
                                   per_layer=self._unrolled())

    def extend(self, tokens: jax.Array, cache: KVCache, valid: jax.Array | None = None,
               window: int | None = None) -> tuple[jax.Array, KVCache]:
        """Append a right-padded chunk to every row of the cache.

        Args:
          tokens: int32 `[B, T]`; row b's tokens go to slots `cache.lengths[b] + t` and get
            those slots as positions.
          cache: the current `KVCache`.
          valid: `[B, T]` 1 on real tokens, which must come first in each row (right padding);
            None means all valid. Rows with no valid token are left unchanged.
          window: attend to cache slots `[0, window)` only (static; None = all S). The caller
            guarantees every valid token's slot is below it; other rows get garbage outputs.
        Returns:
          (hidden `[B, T, D]` final normed states, the new cache with lengths advanced by the
          number of valid tokens per row).
        """
        b, t = tokens.shape
        if valid is None:
            valid = jnp.ones((b, t), jnp.int32)
        slots = kv_cache.append_slots(cache.lengths, t)  # [B, T]
        cos, sin = rope_tables(rope_inv_freq(self.config), slots)
        w = cache.capacity if window is None else min(int(window), cache.capacity)
        mask = kv_cache.cached_attention_mask(slots, w)  # [B, T, W]

        if cache.per_layer != self._unrolled():
            raise ValueError(
                f"KV cache form mismatch: a model that {'unrolls' if self._unrolled() else 'scans'} its layers "
                f"needs per_layer={self._unrolled()} (make the cache with model.init_cache)"
            )

        def body(carry, p, layer):
            x, ks, vs = carry
            q, k, v = self._qkv(p, x, cos, sin)
            if cache.per_layer:  # unrolled: `layer` is a Python int, each layer its own buffer
                k_l = kv_cache.write_slots(ks[layer], slots, k, slots_last=True)
                v_l = kv_cache.write_slots(vs[layer], slots, v)
                ks, vs = ks[:layer] + (k_l,) + ks[layer + 1:], vs[:layer] + (v_l,) + vs[layer + 1:]
            else:  # scanned: `layer` is traced, write into and read from the stacked arrays
                ks = kv_cache.write_slots(ks, slots, k, layer, slots_last=True)
                vs = kv_cache.write_slots(vs, slots, v, layer)
                k_l, v_l = ks[layer], vs[layer]
            if w < cache.capacity:
                k_l, v_l = k_l[..., :w], v_l[:, :, :w]
            return self._finish_block(p, x, attention(q, k_l, v_l, mask, cache_layout=True)), ks, vs

        x, ks, vs = self._layers(body, (self._get("embed")[tokens], cache.k, cache.v), hoist=True)
        hidden = rms_norm(x, self._get("final_norm"), self.config.rms_norm_eps)
        lengths = cache.lengths + jnp.sum(valid > 0, axis=1, dtype=jnp.int32)
        return hidden, KVCache(k=ks, v=vs, lengths=lengths)

    def prefill(self, tokens: jax.Array, cache: KVCache, valid: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """`extend`, returning float32 logits `[B, V]` at each row's last valid token.

        This is how a prompt or a tool observation enters the cache; the logits predict the
        first token to sample. Rows with no valid token return the logits of chunk position 0.
        """
        hidden, cache = self.extend(tokens, cache, valid)
        b, t = tokens.shape
        n = jnp.full((b,), t, jnp.int32) if valid is None else jnp.sum(valid > 0, axis=1, dtype=jnp.int32)
        last = jnp.clip(n - 1, 0, t - 1)  # [B]
        h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, D]
        return self.logits_from_hidden(h_last), cache

    def decode_step(self, token: jax.Array, cache: KVCache, active: jax.Array | None = None,
                    window: int | None = None) -> tuple[jax.Array, KVCache]:
        """One decoding step: int32 `[B]` tokens -> (float32 logits `[B, V]`, new cache).

        `active` `[B]` (1 = append) lets finished rows stand still inside a `while_loop`;
        `window` as in `extend` (every active row's length must be below it).
        """
        valid = None if active is None else active[:, None]
        hidden, cache = self.extend(token[:, None], cache, valid, window)
        return self.logits_from_hidden(hidden[:, 0]), cache
