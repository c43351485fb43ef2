"""DEVICE: per-token log-probs and entropies from logits or final hidden states.

`token_logprobs_and_entropy` scores a whole batch in chunks over T, so no `[B, T, V]`
float32 log-softmax exists; the sampler (per decode step) and the trainer (per chunk) share
`logp_and_entropy_from_logits` for the last step, so their log-probs agree.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["logp_and_entropy_from_logits", "token_logprobs_and_entropy"]


def logp_and_entropy_from_logits(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-prob of `targets` and entropy of softmax(logits), in float32.

    Args: logits `[..., V]`, targets int `[...]`. Returns (logp `[...]`, entropy `[...]`).
    The one numerics path shared by the sampler (per decode step) and the trainer (per chunk).
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    probs = jnp.exp(logits - lse[..., None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return picked - lse, entropy


def token_logprobs_and_entropy(
    hidden: jax.Array, unembedding: jax.Array, tokens: jax.Array, *, chunk_size: int = 64,
    mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probs and entropies without a `[B, T, V]` float32 log-softmax.

    `logp[:, t] = log p(tokens[:, t] | tokens[:, :t])` is read from the logits of position
    t - 1, so `logp[:, 0] = 0`; `entropy[:, t]` is the entropy of that same distribution
    (`entropy[:, 0] = 0`). The sequence axis is cut into chunks of `chunk_size` positions and
    `lax.map` walks over them; each `[B, chunk, V]` block of logits is `jax.checkpoint`ed, so
    the backward pass recomputes it instead of storing it. Peak memory is
    O(B * chunk_size * V) instead of O(B * T * V). Chunks run over T, never over B, so a
    batch sharded over data-parallel devices stays sharded inside every chunk.

    Args:
      hidden: `[B, T, D]` final (normed) hidden states, `CausalLM.hidden_states`.
      unembedding: `[V, D]` output embedding, `CausalLM.unembedding()`.
      tokens: int32 `[B, T]`.
      chunk_size: positions of each row per chunk (static); T is padded up to a multiple.
      mask: optional `[B, T]`, nonzero where the caller reads `logp` / `entropy` (a loss
        mask). A chunk whose positions no row reads is skipped (`lax.cond`): no logits, its
        outputs 0. Every read position, and the gradient of anything that reads only those,
        is exactly the unmasked path's. An agent episode's prompt and the padding up to its
        length bucket carry no loss, so some chunks of a batch can be skipped (what that saves
        per workload: `benchmarks/bench_logp_skip.py`). None: every chunk.
    Returns:
      (logp, entropy), both float32 `[B, T]`.
    """
    if hidden.ndim != 3 or tokens.shape != hidden.shape[:2]:
        raise ValueError(f"hidden {hidden.shape} must be [B, T, D] with tokens {tokens.shape} == [B, T]")
    if unembedding.ndim != 2 or unembedding.shape[1] != hidden.shape[2]:
        raise ValueError(f"unembedding {unembedding.shape} must be [V, D={hidden.shape[2]}]")
    if mask is not None and mask.shape != tokens.shape:
        raise ValueError(f"mask {mask.shape} must be [B, T] like tokens {tokens.shape}")
    b, t, d = hidden.shape
    c = max(1, min(chunk_size, t))
    n = -(-t // c)  # number of chunks
    # targets[:, t] is the token that position t predicts; the last position predicts nothing.
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    h = jnp.pad(hidden, ((0, 0), (0, n * c - t), (0, 0))).reshape(b, n, c, d).transpose(1, 0, 2, 3)  # [n, B, C, D]
    y = jnp.pad(targets, ((0, 0), (0, n * c - t))).reshape(b, n, c).transpose(1, 0, 2)  # [n, B, C]

    @jax.checkpoint
    def chunk(h_c, y_c):
        logits = jnp.einsum("bcd,vd->bcv", h_c, unembedding, preferred_element_type=jnp.float32)
        return logp_and_entropy_from_logits(logits, y_c)

    if mask is None:
        lp, ent = jax.lax.map(lambda args: chunk(*args), (h, y))  # [n, B, C] each
    else:  # position p is read when token p + 1 is: the mask shifted like the targets
        need = jnp.concatenate([mask[:, 1:] != 0, jnp.zeros((b, 1), bool)], axis=1)
        need = jnp.pad(need, ((0, 0), (0, n * c - t))).reshape(b, n, c).transpose(1, 0, 2).any(axis=(1, 2))  # [n]

        def skip(h_c, y_c):
            return jnp.zeros(y_c.shape, jnp.float32), jnp.zeros(y_c.shape, jnp.float32)

        lp, ent = jax.lax.map(lambda args: jax.lax.cond(args[2], chunk, skip, args[0], args[1]), (h, y, need))

    def unchunk(x):
        return x.transpose(1, 0, 2).reshape(b, n * c)[:, :t]

    lp, ent = unchunk(lp), unchunk(ent)
    zero = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([zero, lp[:, :-1]], 1), jnp.concatenate([zero, ent[:, :-1]], 1)
